"""``KEY=VALUE`` options from the command line (``--option``, ``--model-option``)."""
from __future__ import annotations

import json


def parse_value(text: str):
    """JSON where it parses (numbers, lists, null), ``true``/``false``, comma-separated
    lists, else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        low = text.lower()
        if low in ("true", "false"):
            return low == "true"
        if "," in text:
            return [parse_value(t) for t in text.split(",") if t]
        return text


def parse_options(items: list[str] | None, flag: str = "--option") -> dict:
    opts = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        key, val = item.split("=", 1)
        if not key.strip():
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE, the KEY is empty")
        opts[key.strip()] = parse_value(val.strip())
    return opts


def backend_options(items: list[str] | None, flag: str = "--option") -> dict:
    """``--option`` items as backend options: a list option given one value
    (``cudagraph_capture_sizes=256``) is a list of that one value."""
    from ..config import LIST_OPTIONS

    opts = parse_options(items, flag)
    for key in LIST_OPTIONS:
        if isinstance(opts.get(key), (int, float)):  # a JSON object stays a dict, refused as one
            opts[key] = [opts[key]]
    return opts


def model_config(name: str, items: list[str] | None, flag: str = "--model-option"):
    """Preset ``name`` with ``flag`` overrides (``attention_impl=flashinfer``,
    ``kv_source_layer_ids=2,8``); errors name ``flag``."""
    import dataclasses

    from .config import preset

    base = preset(name)
    fields = [f.name for f in dataclasses.fields(base)]
    overrides = {}
    for k, v in parse_options(items, flag).items():
        if k not in fields:
            raise ValueError(f"{flag} {k}: not a model config field; the fields are {', '.join(fields)}")
        if isinstance(v, list):
            v = tuple(v)
        elif isinstance(getattr(base, k), tuple):  # one layer id parses as a number
            v = (v,)
        overrides[k] = v
    try:
        return preset(name, **overrides)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
