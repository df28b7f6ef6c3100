"""The split plan: what the backend built, as a typed record (``inspect``, SPEC §8)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from replay_backend.passes.split import PieceInfo


@dataclass
class SplitPlan:
    window: int | None
    trim_threshold: int
    replay_layers: list[int] | None  # [first, last]
    capture_sizes: list[int]
    replay_capture_sizes: list[int]
    main_pieces: list[PieceInfo] = field(default_factory=list)
    replay_pieces: list[PieceInfo] = field(default_factory=list)
    replay_off_reason: str | None = None  # why the replay region is not in use
    config: dict = field(default_factory=dict)

    def pieces_by_kind(self, which: str = "main") -> dict[str, int]:
        out: dict[str, int] = {}
        for p in (self.main_pieces if which == "main" else self.replay_pieces):
            out[p.kind] = out.get(p.kind, 0) + 1
        return out

    def as_dict(self) -> dict:
        return {
            "window": self.window,
            "trim_threshold": self.trim_threshold,
            "replay_layers": self.replay_layers,
            "capture_sizes": self.capture_sizes,
            "replay_capture_sizes": self.replay_capture_sizes,
            "main_pieces": [p.as_dict() for p in self.main_pieces],
            "replay_pieces": [p.as_dict() for p in self.replay_pieces],
            "replay_off_reason": self.replay_off_reason,
            "config": self.config,
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def render(self) -> str:
        def layers(p):
            if not p.layers:
                return ""
            return f" layers {p.layers[0]}" + (f"..{p.layers[-1]}" if len(p.layers) > 1 else "")

        lines = [
            f"window W={self.window}  trim threshold={self.trim_threshold}  replay layers="
            f"{self.replay_layers if self.replay_layers else 'none'}",
            f"main capture sizes ({len(self.capture_sizes)}): {self.capture_sizes}",
            f"replay capture sizes ({len(self.replay_capture_sizes)}): {self.replay_capture_sizes}",
        ]
        if self.replay_off_reason:
            lines.append(f"decoder replay OFF: {self.replay_off_reason}")
        for title, pieces in (("main graph", self.main_pieces), ("replay region", self.replay_pieces)):
            if not pieces and title == "replay region":
                continue
            kinds = ", ".join(f"{v} {k}" for k, v in self.pieces_by_kind(
                "main" if title == "main graph" else "replay").items())
            lines.append(f"{title}: {len(pieces)} pieces ({kinds})")
            for p in pieces:
                what = p.op if p.op else f"{p.num_ops} ops"
                lines.append(f"  {p.name:<12s} {p.kind:<9s}{layers(p):<16s} {what}")
        return "\n".join(lines)
