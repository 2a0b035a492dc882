"""The server puts an answer's generated ids back in place of its re-tokenized text."""

from __future__ import annotations

from impress_cache.serve.answers import AnswerMemory
from impress_cache.tools.models import SMOLLM2_FILE, smollm2_path


def _sub(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_a_remembered_answer_keeps_its_generated_ids():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path(), gguf_file=SMOLLM2_FILE)
    blank = tok.convert_tokens_to_ids("ĊĊ")  # "\n\n" as the model generates it; the text gives two "\n"
    generated = tok("It says:", add_special_tokens=False)["input_ids"] + [blank] + tok("Yes", add_special_tokens=False)["input_ids"]
    answer = tok.decode(generated)
    assert answer == "It says:\n\nYes"
    messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": answer}, {"role": "user", "content": "Next?"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    plain = tok(rendered, add_special_tokens=False)["input_ids"]
    assert not _sub(plain, generated)  # what the next prompt would hold without the memory

    memory = AnswerMemory()
    memory.remember(tok, "tenant", answer, generated)
    ids = memory.tokenize(tok, rendered, messages, "tenant")
    assert _sub(ids, generated) and tok.decode(ids) == tok.decode(plain)  # same text, generated ids
    assert memory.tokenize(tok, rendered, messages, "other") == plain  # per tenant
    memory.remember(tok, None, "not what they decode to", generated)
    assert memory.recall(None, "not what they decode to") is None
