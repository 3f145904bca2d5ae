"""The run a pytest session belongs to: its options, read once, and its report writer.

`RunSession.from_config` reads every `--parity-*` option once and refuses contradictions with a
`pytest.UsageError`. The run directory is created at the first report row (by whichever process
writes it, under the writer's file lock), together with `run.json`: a pytest session of the
environment that never writes a row (the plugin is installed for every session) leaves nothing.
Under pytest-xdist the controller chooses the run id and hands it to the workers.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from parity import env
from parity.plugin.options import DEFAULT_DTYPE, PYTEST_PREFIX
from parity.report import ReportWriter, new_run_id, write_run_info
from parity.target import TargetError, factory_path

DEFAULT_REPORT_DIR = Path("reports") / "runs"  # relative to the directory pytest was started in
WORKER_RUN_DIR = "parity_run_dir"  # key of the run directory in an xdist worker's workerinput


def option(config: pytest.Config, name: str) -> Any:
    """The value of `--parity-<name>`."""
    return config.getoption(f"{PYTEST_PREFIX}{name}".replace("-", "_"))


@dataclasses.dataclass(frozen=True)
class RunSession:
    """The options of this run, resolved once, as one object a suite can pass around."""

    device: str
    size: str
    dtype: str
    target: str
    run_dir: Path
    seed: int = 0
    suites: tuple[str, ...] = ()
    cases_dirs: tuple[Path, ...] = ()
    checkpoint_layout: str = "parity"

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @classmethod
    def from_config(cls, config: pytest.Config) -> RunSession:
        device = option(config, "device")
        dtype = option(config, "dtype") or DEFAULT_DTYPE[device]
        worker_input = getattr(config, "workerinput", None)
        if worker_input is not None:
            run_dir = Path(worker_input[WORKER_RUN_DIR])
        else:
            base = Path(option(config, "report_dir") or Path(config.invocation_params.dir) / DEFAULT_REPORT_DIR)
            run_dir = base / (option(config, "run_id") or new_run_id())
        cases = tuple(Path(d) for d in option(config, "cases"))
        for directory in cases:
            if not directory.is_dir():
                raise pytest.UsageError(f"--parity-cases {directory}: not a directory")
        return cls(
            device=device,
            size=option(config, "size"),
            dtype=dtype,
            target=option(config, "target"),
            run_dir=run_dir.absolute(),
            seed=option(config, "seed"),
            suites=tuple(option(config, "suite")),
            cases_dirs=tuple(d.absolute() for d in cases),
            checkpoint_layout=option(config, "checkpoint_layout"),
        )

    def run_info(self, config: pytest.Config) -> dict[str, Any]:
        """What `run.json` says about the run: its options and the environment."""
        info = {"run_id": self.run_dir.name, "args": list(config.invocation_params.args), **env.describe(self.device)}
        info.update(size=self.size, dtype=self.dtype, target=self.target, seed=self.seed)
        info["checkpoint_layout"] = self.checkpoint_layout
        try:
            info["target_provenance"] = env.target_provenance(self.target, factory_path(self.target))
        except TargetError as exc:  # an unknown spec: the run stops on it elsewhere; say what was asked
            info["target_provenance"] = {"spec": self.target, "error": str(exc)}
        if self.cases_dirs:
            info["cases_dirs"] = [str(d) for d in self.cases_dirs]
        return info

    def writer(self, config: pytest.Config) -> ReportWriter:
        """The row writer of this process; the first row written by any process creates the run
        directory and its `run.json`."""
        context = {
            "run_id": self.run_dir.name,
            "target": self.target,
            "device": self.device,
            "dtype": self.dtype,
            "size": self.size,
            "torch_version": env.torch_version(),
            "git_sha": env.git_sha(),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        }
        return ReportWriter(self.run_dir, context, on_create=lambda run_dir: write_run_info(run_dir, self.run_info(config)))
