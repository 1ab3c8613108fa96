"""Every file of a study, named once: the workflow's rules, the supervisor, the tracker and the report
find a study's files here instead of walking up from one of them (`parents[N]`) or guessing a sibling.

    results/<study>/                         study_dir
        study.json                           the resolved study the jobs read
        env/environment.json, probe/capabilities.json, data/train.jsonl, models/<model>/
        specs/<cell_id>.json                 a cell's resolved spec, the file its jobs read
        plan.csv, plans/<cell_id>.json, runs/<cell_id>/result.json (and the run's other files), summary.csv, report/
        tracking.json, tracking-sync.json
        doctor/<cell_id>/                    tunegrid doctor's waves for one baseline cell, <mode>/doctor.json
    results/logs/<study>/                    logs_dir: one log per rule, finetune/<cell_id>.log per cell

Light module: standard library only (the Snakefile reads it at parse time).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StudyPaths:
    results: Path  # the folder every study shares (results/): the MLflow store lives beside the studies
    study: str

    @classmethod
    def of(cls, study: str, results: str | Path = "results") -> StudyPaths:
        return cls(Path(results), study)

    @classmethod
    def of_run_dir(cls, run_dir: str | Path) -> StudyPaths:
        """The study a cell's run folder (results/<study>/runs/<cell_id>) belongs to: the folder that holds
        its runs folder, whatever that is named (a cell run by hand may sit in any <study_dir>/<x>/<cell_id>)."""
        study_dir = Path(run_dir).parent.parent
        return cls(study_dir.parent, study_dir.name)

    @classmethod
    def of_result(cls, result_path: str | Path) -> StudyPaths:
        """The study a cell's result.json (results/<study>/runs/<cell_id>/result.json) belongs to."""
        return cls.of_run_dir(Path(result_path).parent)

    @property
    def study_dir(self) -> Path:
        return self.results / self.study

    @property
    def logs_dir(self) -> Path:
        return self.results / "logs" / self.study

    @property
    def study_file(self) -> Path:
        return self.study_dir / "study.json"

    @property
    def environment(self) -> Path:
        return self.study_dir / "env" / "environment.json"

    @property
    def capabilities(self) -> Path:
        return self.study_dir / "probe" / "capabilities.json"

    @property
    def dataset(self) -> Path:
        return self.study_dir / "data" / "train.jsonl"

    def model_dir(self, model: str) -> Path:
        return self.study_dir / "models" / model

    @property
    def runs_dir(self) -> Path:
        return self.study_dir / "runs"

    def run_dir(self, cell_id: str) -> Path:
        return self.runs_dir / cell_id

    def result(self, cell_id: str) -> Path:
        return self.run_dir(cell_id) / "result.json"

    def cell_log(self, cell_id: str) -> Path:
        return self.cell_logs_dir / f"{cell_id}.log"

    @property
    def cell_logs_dir(self) -> Path:
        return self.logs_dir / "finetune"

    @property
    def plan_table(self) -> Path:
        return self.study_dir / "plan.csv"

    def cell_spec(self, cell_id: str) -> Path:
        """The cell's resolved spec (tunegrid.study.config.cell_spec), what its plan and its fine-tune read."""
        return self.study_dir / "specs" / f"{cell_id}.json"

    def cell_plan(self, cell_id: str) -> Path:
        """The cell's plan (tunegrid.prepare.cell_plan.CellPlan) its job takes its memory request from."""
        return self.study_dir / "plans" / f"{cell_id}.json"

    @property
    def summary(self) -> Path:
        return self.study_dir / "summary.csv"

    @property
    def report_dir(self) -> Path:
        return self.study_dir / "report"

    def doctor_dir(self, cell_id: str) -> Path:
        """`tunegrid doctor`'s files for one baseline cell: reproduce.json, diagnosis.json, <mode>/…"""
        return self.study_dir / "doctor" / cell_id

    @property
    def tracking(self) -> Path:
        return self.study_dir / "tracking.json"

    @property
    def tracking_sync(self) -> Path:
        return self.study_dir / "tracking-sync.json"
