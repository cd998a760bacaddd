"""The ``prism`` task: PRISM-FCP, Rob-FCP and FCP (``python -m fedring conformal prism``, or
``task = "prism"`` with a ``[prism]`` settings section, :mod:`.settings`).
"""

from __future__ import annotations

from fedring import validate
from fedring.config import Config, section_settings
from fedring.job import Driver
from fedring.tasks import TASKS, Task

from .attacks import CALIB_ATTACKS, make_calib_attack
from .experiment import METHOD_LABEL, PrismJob
from .settings import TABLE_ATTACKS, PrismSettings, ResolvedPrism
from .uci import superconductivity_file


@TASKS.register
class PrismTask(Task):
    """PRISM-FCP, Rob-FCP and FCP (:mod:`fedring.conformal.prism`)."""

    name = "prism"

    def __init__(self, cfg: Config, world_size: int):
        super().__init__(cfg, world_size)
        self.settings: ResolvedPrism = section_settings(ResolvedPrism, "prism", cfg.section("prism"))
        s = self.settings
        validate.fills_ranks("prism.clients", s.clients, world_size)
        known = ["prism", *CALIB_ATTACKS]
        for section in cfg.sections:
            if section not in known:
                raise validate.unknown(section, "settings section of task prism", section, known)
        for name in CALIB_ATTACKS:
            if name in s.attacks or name in cfg.sections:
                make_calib_attack(name, s.attack_params(name, cfg.section(name)))
        if s.dataset == "uci" and not s.standin:
            superconductivity_file(s.data_dir)

    def default_out(self) -> str:
        s = self.settings
        name = "table" if s.table else f"{s.method}-{s.calib_attack}"
        data = "" if s.dataset == "synthetic" else f"-{s.dataset}"
        return f"results/prism-{name}{data}-s{self.cfg.seed}.h5"

    def steps(self) -> tuple[int, str]:
        return self.settings.trials, "trials"

    def banner(self, world_size: int) -> str:
        s = self.settings
        if s.table:
            what = (
                f"Table {'I' if s.dataset == 'synthetic' else 'II'}: PRISM-FCP, Rob-FCP and FCP under the "
                f"{', '.join(TABLE_ATTACKS)} calibration attacks"
            )
        else:
            shared = s.shared if s.method == "prism" else s.dim
            rule = "" if s.method == "fcp" else f", filter {s.filter}"
            attack = "no calibration attack" if s.calib_attack == "none" else f"calibration attack {s.calib_attack}"
            what = f"{METHOD_LABEL[s.method]} (M={shared} of D={s.dim}{rule}), {attack}"
        data = s.dataset + (" (stand-in file)" if s.standin else "")
        return (
            f"fedring: prism: {what}; {s.clients} clients on {world_size} rank{'s' if world_size > 1 else ''}, "
            f"{s.byzantine} Byzantine ({100 * s.byzantine / s.clients:.0f} %); {data}, profile {s.profile}, "
            f"{s.trials} trial{'s' if s.trials > 1 else ''}, seed {self.cfg.seed} -> {self.cfg.out}"
        )

    def prepare(self, comm) -> Driver:
        return Driver(PrismJob(self.cfg, comm, self.settings), self.cfg, comm)


def main(argv: list[str]) -> int:
    """``python -m fedring conformal prism [options]`` (``--help`` lists them)."""
    from fedring.cli.run import run, section_parser

    parser = section_parser(
        "prism",
        PrismSettings,
        (
            "PRISM-FCP (partial-sharing training, then robust calibration), Rob-FCP and FCP over MPI; one "
            "/calibration row per trial in the HDF5 results file. Every option is also a key of the [prism] "
            'settings section (--set prism.KEY=VALUE, or a TOML file with task = "prism"); a calibration attack\'s '
            "parameters go in the section named after it (--set coverage.factor=5). docs/prism-fcp.md explains them."
        ),
    )
    try:
        return run(argv, parser, section="prism")
    except SystemExit as e:  # settings errors (2) and --help (0), as an exit code
        return e.code if isinstance(e.code, int) else 0
