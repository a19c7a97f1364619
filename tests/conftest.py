"""Shared test fixtures. Slow end-to-end tests are marked ``slow`` and still run in CI.

vLLM on CPU is started with float32 (bit-exact greedy, no bf16 kernel hazards, see
docs/cpu-defaults.md), eager mode (23 s start instead of 90 s) and an explicit KV-cache
size (vLLM's default reserves 92% of RAM).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Tests spawn vLLM processes; keep them on the CPU defaults the product uses.
os.environ.setdefault("VLLM_CLOVER_TEST", "1")
# vLLM's multiprocess executor on CPU puts ~400 MiB of message queues in /dev/shm; a
# container's default 64 MiB makes every engine start fail ("Insufficient space in
# /dev/shm"). There, run the executor in the EngineCore process (no shared memory; the e2e
# tests pass that way with a 64 MiB /dev/shm, docs/cpu-defaults.md) and say so in the header.
SHM_NEEDED = 512 << 20
SMALL_SHM_NOTE = ""
if (os.path.isdir("/dev/shm") and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
        and shutil.disk_usage("/dev/shm").free < SHM_NEEDED):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    SMALL_SHM_NOTE = ("/dev/shm has under 512 MiB free: tests ran vLLM with "
                      "VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process executor)")


def _import_kernels_interpreted() -> None:
    """Without a GPU, import Triton and ``vllm_clover.kernels`` with ``TRITON_INTERPRET=1``,
    then restore the environment. Why: Triton decides when a ``@triton.jit`` function is
    defined whether it is interpreted, for its own language functions (``tl.zeros``, ... at
    ``import triton``) and for ours (at ``import vllm_clover.kernels``). A test module collected
    before tests/unit/kernels/test_triton_kernels.py that imports vLLM's ops
    (tests/unit/cpu/test_linear.py) imports Triton, and the interpreted kernels would then fail
    with "Cannot call @triton.jit'd outside of the scope of a kernel". So this runs before any
    test module is collected. The variable itself must not leak into
    vLLM subprocesses; tests/unit/kernels/test_triton_kernels.py sets it again while its kernels run."""
    import torch

    if torch.cuda.is_available() or "triton" in sys.modules:
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from vllm_clover import kernels  # noqa: F401  (imports Triton too, where it is installed)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


_import_kernels_interpreted()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: end-to-end test that starts vLLM (runs in CI)")
    config.addinivalue_line("markers", "gpu_path: the GPU tree-verification code (FlashAttention KV "
                            "layout, varlen kernel, tree backend metadata); runs in the Triton "
                            "interpreter on CPU, on CUDA where there is one")
    config.addinivalue_line("markers", "distributed: several processes (tensor parallel over gloo, "
                            "Ray, data-parallel training); runs on CPU")


def pytest_report_header(config: pytest.Config) -> str | None:
    return SMALL_SHM_NOTE or None


@pytest.fixture
def one_thread():
    """Tiny models and tensors: one intra-op thread is several times faster than two on a
    loaded 2-core machine (thread start-up and contention dominate); restored after.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from vllm_clover.default_model import ensure_default_model

    return ensure_default_model(verbose=False)


def make_tiny_llama(out: Path, default_model_dir: Path, **overrides) -> Path:
    """Save a random 2-layer Llama (hidden 32 unless ``overrides`` say otherwise) with the
    default model's tokenizer and chat template into ``out``; returns ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    values = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    values.update(overrides)
    LlamaForCausalLM(LlamaConfig(**values)).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A random 2-layer Llama (hidden 32) with the default model's tokenizer and template
    (training / evaluation / baseline tests: features and steps take seconds). Its head
    size 8 is too small for vLLM's CPU attention: tests that start vLLM need their own."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_target"), default_model_dir)


@pytest.fixture(scope="module")
def convs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight short synthetic chats with repetitive answers (ids never in the held-out split)."""
    from vllm_clover.training.data import Conversation, save_conversations

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    convs = []
    for i in range(8):
        answer = " ".join(words[(i + j) % len(words)] for j in range(40))
        convs.append(Conversation(f"synthetic-{i}", [{"role": "user", "content": f"Count from {words[i]}."},
                                                     {"role": "assistant", "content": answer}]))
    path = tmp_path_factory.mktemp("data") / "convs.jsonl"
    save_conversations(convs, path)
    return path


def venv_bin(name: str) -> str:
    """Path of a console script installed next to the running interpreter."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.fail(f"console script {name!r} not installed next to {sys.executable}; run `make test`")
    return str(path)


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


ON_GPU = _on_gpu()
# The dtype matrix of the tests that start vLLM. CPU: float32 (bit-exact greedy, the
# losslessness claim). GPU: bfloat16, because the tree path runs on FlashAttention, which
# has no float32 kernels (float32 would select TRITON_ATTN, which the front end refuses for
# trees), and the drafter follows the model's dtype (draft_dtype is a CPU-build option the
# front end refuses on a GPU).
E2E_DTYPE = "bfloat16" if ON_GPU else "float32"
# Clover options that pin the drafter's dtype: float32 products on CPU (the wiring tests
# compare drafts exactly with the float32 reference), nothing on a GPU.
CLOVER_DTYPE_OPTIONS: dict[str, str] = {} if ON_GPU else {"draft_dtype": "float32"}

E2E_LLM_KWARGS = dict(dtype=E2E_DTYPE, enforce_eager=True, kv_cache_memory_bytes=1 << 30,
                      max_model_len=2048)


def shutdown_llm(llm) -> None:
    """Stop an ``LLM``'s EngineCore/worker processes now, not at interpreter exit."""
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def clover_ckpt_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Clover-2 checkpoint for the default target.

    Trained heads shipped under vllm_clover/heads/<name>/ are used when one fits the
    target; otherwise a drafter is initialised from the target (build_drafter: Aug layers
    copied from its last layer, untrained heads) and saved in float32. Acceptance is then
    low, but losslessness must hold whatever the heads are.
    """
    import torch
    import transformers

    import vllm_clover
    from vllm_clover.model.checkpoint import CloverCheckpointError, save_drafter, validate_checkpoint
    from vllm_clover.model.config import CloverConfig
    from vllm_clover.model.drafter import build_drafter

    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    for cfg_file in sorted((Path(vllm_clover.__file__).parent / "heads").glob("*/config.json")):
        try:
            validate_checkpoint(cfg_file.parent, hf.config)
            return cfg_file.parent
        except CloverCheckpointError:
            continue
    out = tmp_path_factory.mktemp("clover-ckpt")
    config = CloverConfig.from_target_config(hf.config, num_heads=4)
    save_drafter(out, build_drafter(config, target=hf), dtype=torch.float32)
    return out


def sensitize_drafter(drafter, trunk_scale: float = 60.0, head_scale: float = 15.0,
                      gate_bias: float = 100.0, attn_gain: float = 10.0):
    """Make an (untrained) Clover-2 drafter's drafts depend strongly on every input.

    Heads initialised from the target barely look at the fused token E[y] (v ~ U(0, 0.01))
    and their Aug-layer attention is a small term next to a residual stream of norm ~600,
    so drafts would hardly change if y were shifted, the trunk KV were lost or RoPE were
    wrong: a wiring test built on them would have no power. Here both attention decoders
    get gates ~1 (equal large q/k biases: cos(q, k) ~ 1) and v = scale * I, so
    u = x + trunk_scale * E[y] and s_i = s_{i-1} + head_scale * E[prev], and the Aug
    layers' attention output is amplified by attn_gain. The drafts are still bad
    predictions: the heads mostly copy the last token (q ~ one-hot on it), which a
    repetitive text ("ho ho ho ...") makes right ~65% of the time at temperature 0.8, so
    rejection sampling both accepts and rejects.
    """
    import torch

    h = drafter.config.hidden_size
    with torch.no_grad():
        for dec, scale in ((drafter.trunk_decoder, trunk_scale), (drafter.head_decoder, head_scale)):
            dec.q.bias.fill_(gate_bias)
            dec.k.bias.fill_(gate_bias)
            dec.v.weight.copy_(torch.eye(h) * scale)
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.mul_(attn_gain)
    return drafter


# Prompt the sensitized drafter's heads are fitted to (tests/e2e/test_clover.py samples it).
FIT_PROMPT = "Once upon a time there was a"


def fit_heads_to_prompt(drafter, hf, tokenizer, prompt: str = FIT_PROMPT, samples: int = 32,
                        new_tokens: int = 6, temperature: float = 0.8, ridge: float = 1e-2):
    """Give the heads real acceptance on continuations of ``prompt``, by ridge regression.

    The target (HF) samples ``samples`` continuations (T=0.8, top-p 0.95, fixed seed);
    head0_proj is fitted so that head0_proj(z_t) ~ x_{t+1} (the target's pre-norm state
    whose logits give token t+2; head_norm is the target's final norm), and the shared
    head_proj so that head_proj([s_i; E[y]]) ~ x_{t+1+i} along the teacher-forced chain.
    On fresh samples the drafts then overlap the target's distribution by ~0.4-1.0 (HF
    estimate), so rejection sampling accepts and rejects. The trunk is left as is.
    """
    import torch

    from vllm_clover.training.features import prenorm_hidden

    def solve(a, b):
        a1 = torch.cat([a, torch.ones(a.shape[0], 1)], 1).double()
        reg = ridge * a1.pow(2).mean() * torch.eye(a1.shape[1], dtype=torch.float64)
        w = torch.linalg.solve(a1.T @ a1 + reg, a1.T @ b.double())
        return w[:-1].T.float(), w[-1].float()

    with torch.inference_mode():
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        torch.manual_seed(0)
        seqs = hf.generate(ids.expand(samples, -1), attention_mask=torch.ones(samples, ids.shape[1], dtype=torch.long),
                           max_new_tokens=new_tokens, do_sample=True, temperature=temperature, top_p=0.95,
                           top_k=0, pad_token_id=0)
        x = prenorm_hidden(hf.model, hf.model.norm, seqs, torch.ones_like(seqs))
        z, _ = drafter.trunk(x[:, :-1], seqs[:, 1:])
        length, first = seqs.shape[1], ids.shape[1] - 2
        hidden = z.shape[-1]
        w, b = solve(z[:, first:length - 2].reshape(-1, hidden), x[:, first + 1:length - 1].reshape(-1, hidden))
        drafter.head0_proj.weight.copy_(w)
        drafter.head0_proj.bias.copy_(b)
        inputs, targets, state = [], [], z
        for i in range(1, 3):
            prev = seqs[:, 1 + i:]
            e = drafter.embed(prev, state)
            state = drafter.head_decoder(state[:, :prev.shape[1]], e)
            inputs.append(torch.cat([state, e], -1)[:, first:length - 2 - i].reshape(-1, 2 * hidden))
            targets.append(x[:, first + 1 + i:length - 1].reshape(-1, hidden))
        w, b = solve(torch.cat(inputs), torch.cat(targets))
        drafter.head_proj.weight.copy_(w)
        drafter.head_proj.bias.copy_(b)
    return drafter


@pytest.fixture(scope="session")
def sensitive_ckpt_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Clover-2 checkpoint (4 heads, float32) built from the target, sensitized (see
    :func:`sensitize_drafter`) and with heads fitted to :data:`FIT_PROMPT`
    (:func:`fit_heads_to_prompt`): for tests that compare drafts or need acceptance."""
    import torch
    import transformers

    from vllm_clover.model.checkpoint import save_drafter
    from vllm_clover.model.config import CloverConfig
    from vllm_clover.model.drafter import build_drafter

    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    torch.manual_seed(0)
    drafter = sensitize_drafter(build_drafter(CloverConfig.from_target_config(hf.config, num_heads=4),
                                              target=hf))
    fit_heads_to_prompt(drafter, hf, tokenizer)
    out = tmp_path_factory.mktemp("clover-sensitive-ckpt")
    save_drafter(out, drafter, dtype=torch.float32)
    return out


# Known open defects: test node id -> reason. Listed in one place so they stay visible
# (reported as XFAIL, and as XPASS once fixed, at which point the entry must go).
KNOWN_FAILURES: dict[str, str] = {
    # None open; the gaps that were checked: docs/design-proposer.md, "Verification of the
    # remaining gaps".
}


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        reason = KNOWN_FAILURES.get(item.nodeid)
        if reason:
            item.add_marker(pytest.mark.xfail(reason=f"known defect: {reason}", strict=False))


# --- why did it fail? ---------------------------------------------------------------------
# An engine that dies at start-up reports "Engine core initialization failed. See root cause
# above." and the root cause sits in the failed test's captured stderr, far above the tail
# of a CI log. Repeat each distinct exception line from failed tests' captured output, and
# the memory/disk figures vLLM's start-up checks use, at the very end of the run.
# "SomeError: message" or a bare "AssertionError", after an optional vLLM log prefix.
_EXCEPTION_LINE = re.compile(r"^(?:.*\] )?((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception))(?:: (.+))?$")
_NOT_A_ROOT_CAUSE = ("Engine core initialization failed", "See root cause above")


def root_cause_lines(texts: list[str], limit: int = 15) -> list[str]:
    """Distinct exception lines in ``texts``, first-seen order, at most ``limit``; a bare
    exception name (a failed ``assert``) comes with the source line before it."""
    seen: dict[str, None] = {}
    for text in texts:
        previous = ""
        for raw in text.splitlines():
            match = _EXCEPTION_LINE.match(raw.strip())
            if match:
                name, message = match.groups()
                line = f"{name}: {message.strip()}" if message else f"{name} at: {previous}"
                if not any(s in line for s in _NOT_A_ROOT_CAUSE):
                    seen.setdefault(line[:400], None)
            elif raw.strip() and not set(raw.strip()) <= set("^~ "):
                previous = re.sub(r"^.*\] ", "", raw.strip())
    return list(seen)[:limit]


def _machine_snapshot() -> list[str]:
    lines = [f"disk free: {shutil.disk_usage(REPO).free / 2**30:.1f} GiB under {REPO}, "
             f"{shutil.disk_usage('/tmp').free / 2**30:.1f} GiB under /tmp"]
    if os.path.isdir("/dev/shm"):  # vLLM's message queues want ~400 MiB there
        lines.append(f"/dev/shm free: {shutil.disk_usage('/dev/shm').free / 2**20:.0f} MiB")
    try:
        from vllm.utils import cpu_resource_utils as cru

        info = cru.get_memory_node_info(0)
        lines.append(f"vLLM memory view (node 0): {info.available_memory / 2**30:.1f} of "
                     f"{info.total_memory / 2**30:.1f} GiB available; cgroup limit "
                     f"{cru.get_cgroup_memory_limit()}, usage {cru.get_cgroup_memory_usage()}")
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not fail the run
        lines.append(f"vLLM memory view unavailable: {exc!r}")
    return lines


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    result = yield  # after pytest's own summaries: the last thing a log tail shows
    failed = [r for key in ("failed", "error") for r in terminalreporter.stats.get(key, [])]
    if not failed:
        return result
    texts = [content for r in failed for _, content in getattr(r, "sections", [])]
    texts += [str(getattr(r, "longrepr", "") or "") for r in failed]
    terminalreporter.section("root causes in failed tests' output")
    for line in root_cause_lines(texts) + _machine_snapshot():
        terminalreporter.write_line(line)
    return result
