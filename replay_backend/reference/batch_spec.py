"""The ``--batch`` mini-language of ``replay-backend verify`` and ``demo``.

Comma-separated requests: ``p:Q/S`` a prefill chunk of Q tokens ending at sequence
length S (``p:Q`` = ``p:Q/Q``), ``d:Q/S`` a decode of Q tokens at length S, ``k:Q/S`` a
prefill that keeps all rows. A suffix ``@F`` sets the request's replay floor
(``kv_start``), as the soak prints its steps: ``p:869/1091@971``.
"""
from __future__ import annotations

import re

from ..requests import RequestChunk

# The grammar as ``--batch --help`` prints it.
GRAMMAR = """\
--batch is one step, as comma-separated requests (1 <= Q <= S, the step's tokens
the sum of the Q):
  p:Q/S   a prefill chunk of Q tokens ending at sequence length S (S - Q cached
          before it); p:Q is p:Q/Q, a whole prompt
  d:Q/S   a decode of Q tokens at sequence length S (S is required)
  k:Q/S   a prefill that keeps all rows (never trimmed; k:Q is k:Q/Q)
  @F      optional suffix of any request: its replay floor (kv_start), F < S
example: --batch 'd:1/700,p:250,p:60/260@100,k:140'"""

_ITEM = re.compile(r"^([pdk]):(\d+)(?:/(\d+))?(?:@(\d+))?$")


def parse_batch_spec(spec: str) -> list[RequestChunk]:
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise ValueError(f"--batch {spec!r}: no requests (expected e.g. 'd:1/700,p:250,p:60/260')")
    reqs = []
    for i, item in enumerate(items):
        m = _ITEM.match(item)
        if not m:
            raise ValueError(f"--batch item {i} {item!r}: expected KIND:Q[/S][@F] with KIND in p, d, k")
        kind, q = m.group(1), int(m.group(2))
        s = int(m.group(3)) if m.group(3) else q
        if q < 1 or s < q:
            raise ValueError(f"--batch item {i} {item!r}: need 1 <= Q <= S")
        if kind == "d" and not m.group(3):
            raise ValueError(f"--batch item {i} {item!r}: a decode needs its sequence length (d:Q/S)")
        floor = int(m.group(4)) if m.group(4) is not None else None
        if floor is not None and floor >= s:
            raise ValueError(f"--batch item {i} {item!r}: the floor F must lie below S")
        try:
            reqs.append(RequestChunk(f"r{i}", q, s, keep_all=(kind == "k"), kv_start=floor))
        except ValueError as e:
            raise ValueError(f"--batch item {i} {item!r}: {e}") from None
    return reqs
