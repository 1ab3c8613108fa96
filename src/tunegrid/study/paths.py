"""Every file of a study, named once: the workflow's rules (through workflow/rules/common.smk), the supervisor,
the tracker and the report find a study's files here instead of spelling them or walking up from one of them
(`parents[N]`). A rule's file with a wildcard is the member called with the wildcard: `cell_spec("{cell_id}")`.

    results/                                 results: the folder every study shares (mlartifacts/: MLflow's)
    results/<study>/                         study_dir
        study.json                           the resolved study the jobs read
        env/environment.json, env/pip-freeze.txt, probe/capabilities.json, probe/mlflow.json
        data/train.jsonl, models/<model>/, stacks/<stack>/stack.json (and pip-freeze.txt)
        specs/<cell_id>.json                 a cell's resolved spec, the file its jobs read
        plan.csv, plans/<cell_id>.json, runs/<cell_id>/result.json (and the run's other files)
        summary.csv, summary.parquet, report/ (index.html, its figures, recommendations.json)
        tracking.json, tracking-sync.json, tracking-review.json
        benchmarks/<rule>/<name>.tsv         Snakemake's timing of a cell's or a stack's job
        doctor/<cell_id>/                    tunegrid doctor's waves for one baseline cell: reproduce.json,
                                             diagnosis.json, <mode>/try-<n>.json, <mode>/doctor.json, ...
    results/logs/<study>/                    logs_dir: <rule>.log, or <rule>/<wildcards>.log for a job of many

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

    def log(self, *names: str) -> Path:
        """A rule's log: `log("dataset")` is logs_dir/dataset.log, `log("checkpoint", "{model}")` one job's of
        many, logs_dir/checkpoint/{model}.log."""
        return self.logs_dir.joinpath(*names[:-1]) / f"{names[-1]}.log"

    def benchmark(self, rule: str, name: str) -> Path:
        """Snakemake's timing of one job of a rule (its benchmark file)."""
        return self.study_dir / "benchmarks" / rule / f"{name}.tsv"

    @property
    def artifacts(self) -> Path:
        """Where a study's MLflow store, the default one, keeps its artifacts: beside every study's."""
        return self.results / "mlartifacts"

    @property
    def study_file(self) -> Path:
        return self.study_dir / "study.json"

    @property
    def environment(self) -> Path:
        return self.study_dir / "env" / "environment.json"

    @property
    def pip_freeze(self) -> Path:
        return self.study_dir / "env" / "pip-freeze.txt"

    @property
    def capabilities(self) -> Path:
        return self.study_dir / "probe" / "capabilities.json"

    @property
    def probe_run(self) -> Path:
        """The probe's MLflow run (its id), the run each cell's links to."""
        return self.study_dir / "probe" / "mlflow.json"

    @property
    def dataset(self) -> Path:
        return self.study_dir / "data" / "train.jsonl"

    def model_dir(self, model: str) -> Path:
        return self.study_dir / "models" / model

    def stack_record(self, stack: str) -> Path:
        """A library stack's record (tunegrid.study.stacks), written last when the stack is built."""
        return self.study_dir / "stacks" / stack / "stack.json"

    def stack_freeze(self, stack: str) -> Path:
        return self.study_dir / "stacks" / stack / "pip-freeze.txt"

    def run_dir(self, cell_id: str) -> Path:
        return self.study_dir / "runs" / cell_id

    def result(self, cell_id: str) -> Path:
        return self.run_dir(cell_id) / "result.json"

    def cell_log(self, cell_id: str) -> Path:
        return self.log("finetune", cell_id)

    @property
    def cell_logs_dir(self) -> Path:
        """The cells' logs (the finetune rule's), which the MLflow sync and the report read."""
        return self.logs_dir / "finetune"

    @property
    def plan_table(self) -> Path:
        return self.study_dir / "plan.csv"

    def cell_spec(self, cell_id: str) -> Path:
        """The cell's resolved spec (tunegrid.study.config.cell_spec), what its plan and its fine-tune read."""
        return self.study_dir / "specs" / f"{cell_id}.json"

    def cell_plan(self, cell_id: str) -> Path:
        """The cell's contract (tunegrid.contract.CellContract): its spec, plan and job, made by the cell_plan rule."""
        return self.study_dir / "plans" / f"{cell_id}.json"

    @property
    def summary(self) -> Path:
        return self.study_dir / "summary.csv"

    @property
    def summary_parquet(self) -> Path:
        return self.study_dir / "summary.parquet"

    def report_file(self, name: str) -> Path:
        """One file of the report (tunegrid.review.report writes them): index.html, a figure, recommendations.json."""
        return self.study_dir / "report" / name

    @property
    def tracking(self) -> Path:
        return self.study_dir / "tracking.json"

    @property
    def tracking_sync(self) -> Path:
        return self.study_dir / "tracking-sync.json"

    @property
    def tracking_review(self) -> Path:
        """What the mlflow_review rule wrote onto the study's runs: the view's key, the runs it linked."""
        return self.study_dir / "tracking-review.json"

    def doctor_reproduce(self, cell_id: str) -> Path:
        return self._doctor_dir(cell_id) / "reproduce.json"

    def doctor_diagnosis(self, cell_id: str) -> Path:
        return self._doctor_dir(cell_id) / "diagnosis.json"

    def doctor_try(self, cell_id: str, mode: str, index: int | str) -> Path:
        """One wave's verdict: did a fix of the baseline hold (mode `first` stops at the first that does)."""
        return self._doctor_dir(cell_id) / mode / f"try-{index}.json"

    def doctor_file(self, cell_id: str, mode: str, name: str) -> Path:
        """The doctor's verdict for one mode: doctor.json, screen.txt, summary.csv, report/index.html."""
        return self._doctor_dir(cell_id) / mode / name

    def _doctor_dir(self, cell_id: str) -> Path:
        """`tunegrid doctor`'s files for one baseline cell: reproduce.json, diagnosis.json, <mode>/…"""
        return self.study_dir / "doctor" / cell_id
