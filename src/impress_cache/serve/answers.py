"""The token ids of recent answers, so that the next turn's prompt holds them as generated.

A chat client sends the previous answer back as text; the chat template renders it, and
tokenizing that text need not give back the ids the model generated (a blank line can be
one token when generated and two when the text is tokenized again), so the next prompt
would stop matching the stored answer there. The server keeps each tenant's recent
answers (text -> generated ids, only where decoding the ids gives the text exactly) and
tokenizes a rendered chat prompt piece by piece, putting the remembered ids in place of
each assistant message it knows. The prompt's text is unchanged.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


class AnswerMemory:
    """``(tenant, answer text) -> generated ids`` for the last ``capacity`` answers."""

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._ids: OrderedDict[tuple[str | None, str], list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, tokenizer: Any, salt: str | None, text: str, ids: Sequence[int]) -> None:
        """Keep ``ids`` for ``text`` if they decode to exactly that text."""
        if not text or not ids or tokenizer.decode(list(ids), skip_special_tokens=True) != text:
            return
        with self._lock:
            self._ids[(salt, text)] = list(ids)
            self._ids.move_to_end((salt, text))
            while len(self._ids) > self._capacity:
                self._ids.popitem(last=False)

    def recall(self, salt: str | None, text: str) -> list[int] | None:
        with self._lock:
            return self._ids.get((salt, text))

    def tokenize(self, tokenizer: Any, rendered: str, messages: Sequence[dict[str, Any]], salt: str | None) -> list[int]:
        """The ids of the rendered chat prompt ``rendered``: the text between remembered
        assistant messages tokenized as usual, the messages as they were generated."""
        ids: list[int] = []
        at = 0
        for m in messages:
            if m.get("role") != "assistant" or not isinstance(m.get("content"), str):
                continue
            known = self.recall(salt, m["content"])
            where = rendered.find(m["content"], at) if known is not None else -1
            if where < 0:
                continue
            ids += tokenizer(rendered[at:where], add_special_tokens=False)["input_ids"] if where > at else []
            ids += known
            at = where + len(m["content"])
        ids += tokenizer(rendered[at:], add_special_tokens=False)["input_ids"] if at < len(rendered) else []
        return ids
