"""The user's own components: --plugin, import paths, entry points, and their failures (fedring.plugins)."""

import json
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
from conftest import MPIEXEC, mpi_env

from fedring import plugins
from fedring.cli.run import build_config
from fedring.errors import ConfigError

#: a plugin module: an attack registered by name, a server rule and a model used by import path
LAB = """
import numpy as np
from torch import nn
from fedring.aggregators.base import AggregateResult, Aggregator
from fedring.attacks import ATTACKS
from fedring.attacks.base import ModelAttack


@ATTACKS.register
class Negate(ModelAttack):
    name = "{prefix}negate"

    def __init__(self, *, scale: float = 2.0):
        self.scale = scale

    def craft(self, byz, honest, ctx):
        return -self.scale * byz


class Trim(Aggregator):
    name = "{prefix}trim"

    def __init__(self, f=0, *, beta: float = 0.1):
        super().__init__(f)
        self.beta = beta

    def _aggregate(self, X, state, reference, rng):
        k = int(self.beta * len(X))
        return AggregateResult(np.sort(X, axis=0)[k:len(X) - k].mean(axis=0))


class Net(nn.Sequential):
    name = "{prefix}net"
    input_shape = (1, 28, 28)

    def __init__(self):
        super().__init__(nn.Flatten(), nn.Linear(784, 10))
"""


@pytest.fixture(autouse=True)
def registries():
    """Every registry as it was before the test: a plugin's components do not outlive it (other
    in-process tests list the registered names)."""
    from fedring.aggregators import AGGREGATORS, PRE_AGGREGATORS
    from fedring.attacks import ATTACKS
    from fedring.comm import RING_RULES
    from fedring.conformal.prism.attacks import CALIB_ATTACKS
    from fedring.datasets import DATASETS
    from fedring.tasks import TASKS
    from fedring.train.models import MODELS
    from fedring.train.schedules import SCHEDULES

    every = (AGGREGATORS, PRE_AGGREGATORS, ATTACKS, RING_RULES, CALIB_ATTACKS, DATASETS, TASKS, MODELS, SCHEDULES)
    saved = [dict(r._classes) for r in every]
    yield
    for registry, classes in zip(every, saved):
        registry._classes.clear()
        registry._classes.update(classes)


@pytest.fixture
def lab(tmp_path, monkeypatch, request):
    """A plugin module under a name of its own (a module, once imported, stays in sys.modules)."""
    name = f"lab_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(LAB.format(prefix=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def config(tmp_path, *args):
    return build_config(["--dataset", "synthetic", "--clients", "4", "--out", str(tmp_path / "r.h5"), *args], 1)


def test_plugin_registers_its_components_and_is_part_of_the_config(tmp_path, lab):
    from fedring.attacks import ATTACKS, make_attack

    cfg = config(tmp_path, "--plugin", lab, "--byzantine", "1", "--attack", f"{lab}negate", "--set", "attack.scale=3")
    assert cfg.plugins == [lab] and json.loads(cfg.to_json())["plugins"] == [lab]
    attack = make_attack(cfg.attack, cfg.section("attack"), n_clients=4)
    assert type(attack) is ATTACKS[f"{lab}negate"] and attack.scale == 3


def test_import_paths_name_components_with_their_sections(tmp_path, lab):
    from fedring.aggregators import AGGREGATORS, make_aggregator
    from fedring.train.models import make_model, n_parameters

    cfg = config(
        tmp_path,
        "--topology",
        "server",
        "--aggregator",
        f"{lab}:Trim",
        "--set",
        f"{lab}:Trim.beta=0.25",
        "--model",
        f"{lab}:Net",
    )
    assert cfg.sections == {f"{lab}:Trim": {"beta": 0.25}} and cfg.plugins == []
    rule = make_aggregator(cfg.aggregator, 0, cfg.section(cfg.aggregator))
    assert type(rule) is AGGREGATORS[f"{lab}:Trim"] and rule.beta == 0.25
    X = np.array([[0.0], [1.0], [2.0], [100.0]], np.float32)
    assert rule(X).tolist() == [1.5]  # beta 0.25 of 4 rows: drop one at each end
    assert n_parameters(make_model(cfg.model, 0, (1, 28, 28))) == 7850
    assert cfg.out.endswith("r.h5")


def test_import_path_in_a_toml_section_with_a_dotted_module(tmp_path, lab):
    pkg = tmp_path / "pkg_of_lab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "rules.py").write_text(f"from {lab} import Trim\n")
    (tmp_path / "c.toml").write_text(
        'topology = "server"\naggregator = "pkg_of_lab.rules:Trim"\n["pkg_of_lab.rules:Trim"]\nbeta = 0.3\n'
    )
    cfg = config(tmp_path, "--config", str(tmp_path / "c.toml"))
    assert cfg.sections == {"pkg_of_lab.rules:Trim": {"beta": 0.3}}
    cfg = config(
        tmp_path,
        "--topology",
        "server",
        "--aggregator",
        "pkg_of_lab.rules:Trim",
        "--set",
        "pkg_of_lab.rules:Trim.beta=0.3",
    )
    assert cfg.sections == {"pkg_of_lab.rules:Trim": {"beta": 0.3}}


def test_every_component_key_takes_an_import_path(tmp_path, monkeypatch):
    """ring rule, pre-aggregator, data set and calibration attack (model, rule, attack above)."""
    from fedring.aggregators import PRE_AGGREGATORS
    from fedring.comm import RING_RULES
    from fedring.conformal.prism.attacks import CALIB_ATTACKS
    from fedring.datasets import DATASETS

    (tmp_path / "kinds_lab.py").write_text(
        textwrap.dedent("""
        from fedring.aggregators.preaggregators import Bucketing
        from fedring.comm.ring import RingAllReduce
        from fedring.conformal.prism.attacks import EfficiencyAttack
        from fedring.datasets.synthetic import Synthetic
        class Ring(RingAllReduce): name = "my-ring"
        class Pre(Bucketing): name = "my-pre"
        class Calib(EfficiencyAttack): name = "my-calib"
        class Data(Synthetic): name = "my-data"
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config(tmp_path, "--aggregator", "kinds_lab:Ring", "--dataset", "kinds_lab:Data")
    config(tmp_path, "--topology", "server", "--pre-aggregators", "kinds_lab:Pre")
    build_config(["--calib-attack", "kinds_lab:Calib", "--out", str(tmp_path / "p.h5")], 1, *_prism_parser())
    for registry, name in (
        (RING_RULES, "Ring"),
        (PRE_AGGREGATORS, "Pre"),
        (DATASETS, "Data"),
        (CALIB_ATTACKS, "Calib"),
    ):
        assert registry[f"kinds_lab:{name}"].__name__ == name


def _prism_parser():
    from fedring.cli.run import section_parser
    from fedring.conformal.prism.task import PrismSettings

    return section_parser("prism", PrismSettings, ""), "prism"


@pytest.mark.parametrize(
    "source,args,message",
    [
        (
            None,
            ["--plugin", "no_such_lab"],
            (
                "plugins: plugin module 'no_such_lab' not found on this rank's sys.path (install it, add its folder to "
                "PYTHONPATH, or run from the folder that holds it; docs/tutorial.md)"
            ),
        ),
        (
            "raise RuntimeError('database not reachable')",
            ["--plugin", "{m}"],
            "plugins: plugin module '{m}' raised on import: RuntimeError: database not reachable",
        ),
        (
            "import no_such_dependency_of_lab",
            ["--plugin", "{m}"],
            "plugins: plugin module '{m}' raised on import: ModuleNotFoundError: No module named 'no_such_dependency_of_lab'",
        ),
        (
            (
                "from fedring.attacks import ATTACKS\nfrom fedring.attacks.base import ModelAttack\n"
                "@ATTACKS.register\nclass Nameless(ModelAttack): pass"
            ),
            ["--plugin", "{m}"],
            (
                "plugins: plugin module '{m}' raised on import: TypeError: Nameless needs a class attribute name, "
                "a non-empty string without ':' (got None)"
            ),
        ),
        (
            (
                "from fedring.attacks import ATTACKS\nfrom fedring.attacks.base import ModelAttack\n"
                "@ATTACKS.register\nclass Gauss(ModelAttack): name = 'gaussian'"
            ),
            ["--plugin", "{m}"],
            "plugins: plugin module '{m}' raised on import: ValueError: two attacks are named 'gaussian': ",
        ),
        (
            "class Rule: name = 'r'",
            ["--topology", "server", "--aggregator", "{m}:Rule"],
            "aggregator: {m}:Rule: Rule is not one of fedring's aggregators: it must subclass fedring.aggregators.base.Aggregator",
        ),
        ("import math", ["--byzantine", "1", "--attack", "{m}:math"], "attack: {m}:math: a module, not a class"),
        ("x = 1", ["--model", "{m}:Net"], "model: {m}:Net: module {m} has no 'Net'"),
        (
            "from torch import nn\nclass Net(nn.Linear): name = 'n'",
            ["--model", "{m}:Net"],
            "model: {m}:Net: Net needs the class attribute(s) input_shape of a model",
        ),
        (None, ["--plugin", "3d-lab"], "plugins: '3d-lab' is not a module name (package.module)"),
    ],
    ids=[
        "missing",
        "raises",
        "dependency",
        "nameless",
        "clash",
        "not-a-rule",
        "not-a-class",
        "no-attribute",
        "no-input-shape",
        "not-a-name",
    ],
)
def test_a_bad_plugin_is_one_config_error_naming_it(tmp_path, monkeypatch, request, source, args, message):
    module = f"bad_{request.node.callspec.id.replace('-', '_')}"
    if source is not None:
        (tmp_path / f"{module}.py").write_text(source + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = [a.format(m=module) for a in args]
    with pytest.raises(ConfigError) as e:
        if args[-1].endswith(":Net"):  # the model is built (and checked) when the trainer starts
            from fedring.train.models import make_model

            make_model(args[-1], 0)
        else:
            config(tmp_path, *args)
    assert str(e.value).startswith(message.format(m=module))


def test_entry_points_are_loaded_at_start(tmp_path, monkeypatch):
    dist = tmp_path / "lab_dist-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-dist\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fedring.plugins]\nlab = ep_lab\n")
    (tmp_path / "ep_lab.py").write_text(LAB.format(prefix="ep_lab"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    cfg = config(tmp_path, "--byzantine", "1", "--attack", "ep_labnegate")
    assert cfg.plugins == [] and "ep_lab" in sys.modules

    (dist / "entry_points.txt").write_text("[fedring.plugins]\nbroken = ep_broken\n")
    (tmp_path / "ep_broken.py").write_text("raise ImportError('needs a GPU')\n")
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    with pytest.raises(
        ConfigError,
        match=r"^plugins: entry point broken = ep_broken of lab-dist \(fedring.plugins\) "
        r"failed to load: ImportError: needs a GPU$",
    ):
        config(tmp_path)


@pytest.mark.mpi
def test_multi_rank_bad_plugin_stops_every_rank_with_one_message_and_no_file(tmp_path):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    (tmp_path / "raising_lab.py").write_text(
        "import os\nif os.environ.get('PMI_RANK') == '1':\n    raise RuntimeError('only rank 1 fails')\n"
    )
    out = tmp_path / "r.h5"
    env = mpi_env()
    proc = subprocess.run(
        [
            MPIEXEC,
            "-n",
            "2",
            sys.executable,
            "-m",
            "fedring",
            "run",
            "--plugin",
            "raising_lab",
            "--dataset",
            "synthetic",
            "--rounds",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "fedring: error (on rank 1): plugins: plugin module 'raising_lab' raised on import: "
        "RuntimeError: only rank 1 fails"
    )
    assert proc.stdout == "" and not out.exists()


@pytest.mark.mpi
@pytest.mark.slow
def test_resume_imports_the_plugins_stored_in_the_file(tmp_path):
    """Started with --plugin and interrupted; --resume without it continues bit-identically."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    (tmp_path / "resume_lab.py").write_text(LAB.format(prefix="resume_lab"))
    (tmp_path / "crash.py").write_text(
        textwrap.dedent("""
        import sys
        import fedring.train.loop as training
        original = training.train_round
        def train_round(tr, t):
            if t == 3:
                raise SystemExit(75)
            return original(tr, t)
        training.train_round = train_round
        from fedring.cli import main
        sys.exit(main(sys.argv[1:]))
        """)
    )
    common = [
        "--dataset",
        "synthetic",
        "--clients",
        "4",
        "--rounds",
        "6",
        "--eval-every",
        "3",
        "--checkpoint-every",
        "2",
        "--byzantine",
        "1",
        "--attack",
        "resume_labnegate",
        "--topology",
        "server",
        "--aggregator",
        "resume_lab:Trim",
        "--quiet",
    ]
    env = mpi_env()

    def launch(*args, script=("-m", "fedring")):
        return subprocess.run(
            [MPIEXEC, "-n", "2", sys.executable, *script, "run", *args],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=tmp_path,
            env=env,
            check=False,
        )

    whole = launch("--plugin", "resume_lab", *common, "--out", "whole.h5")
    assert whole.returncode == 0, whole.stderr
    cut = launch("--plugin", "resume_lab", *common, "--out", "cut.h5", script=("crash.py",))
    assert cut.returncode != 0
    resumed = launch(*common, "--out", "cut.h5", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    with h5py.File(tmp_path / "whole.h5") as a, h5py.File(tmp_path / "cut.h5") as b:
        assert json.loads(b.attrs["config"])["plugins"] == ["resume_lab"] and b.attrs["status"] == "complete"
        np.testing.assert_array_equal(a["model/final"][()], b["model/final"][()])
        np.testing.assert_array_equal(a["metrics/test_accuracy"][()], b["metrics/test_accuracy"][()])


def test_a_registry_imports_the_modules_it_names_on_its_first_read():
    # CRFL's ring rule is defined with its server rule: the comm layer's registry alone lists it,
    # and reading it imports no torch (the comm layer never does)
    code = "import sys; from fedring.comm import RING_RULES; print(','.join(RING_RULES), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["brace,crfl,mean,rlr,signsgd", "False"]
