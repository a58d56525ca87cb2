"""What a report section sees: the loaded results, the published records and the verdicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReportContext:
    scale: str
    published: dict[str, dict]
    claims: dict[str, dict]
    settings: dict[str, Any] = field(default_factory=dict)
    by_stage: dict[str, list[dict]] = field(default_factory=dict)
    recorded: dict[str, dict] = field(default_factory=dict)
    # a report made elsewhere (reports/recorded.yaml, key gpu_report): {"label", "path", "scale", "claims": {id: claim}}
    recorded_report: dict | None = None
    # stage outputs the report could not use, each naming the file and key (shown on the page)
    problems: list[str] = field(default_factory=list)
    # what of reports/recorded.yaml could not be shown (a missing or malformed list, an absent file)
    recorded_notes: list[str] = field(default_factory=list)

    @property
    def paper_runs(self) -> bool:
        """Whether the scale trains the paper's own runs (config.yaml ``paper_runs``): values are
        compared with the paper's, and no run stands for another."""
        return bool(self.settings.get("paper_runs"))

    def results(self, stage: str) -> list[dict]:
        """Result JSONs of ``stage`` produced by this run (empty if the stage has not run)."""
        return self.by_stage.get(stage, [])

    def claims_with_prefix(self, prefix: str) -> list[dict]:
        return [c for cid, c in self.claims.items() if cid.startswith(prefix)]
