"""Language-model training: a :class:`regattn.models.DecoderLM` on the standard-library byte corpus.

    python -m regattn.train lm --mixer parallax --steps 2000
    torchrun --nproc-per-node 2 -m regattn.train lm --mixer gatedfwa --window 128 --checkpoint ckpt/gfwa

Muon (hidden matrices) with an Adam-style update for embeddings and norms, or AdamW, under a WSD or
cosine schedule (:mod:`regattn.train.optim`, :mod:`regattn.train.schedules`); gradient clipping;
bf16 autocast on CUDA; validation perplexity ``exp(mean NLL per token)`` over fixed windows of the
held-out files (:mod:`regattn.data.text`).

Under ``torchrun`` (``WORLD_SIZE > 1``) every block and then the whole model are sharded with FSDP2
(``torch.distributed.fsdp.fully_shard``) on NCCL (CUDA) or gloo (CPU); each rank draws its own
batches, so the global batch is ``batch_size * world_size`` sequences. ``--activation-checkpointing``
recomputes each block in the backward pass. Checkpoints are ``torch.distributed.checkpoint`` folders
(model and optimizer, resharded on load) plus ``meta.json`` (step, history), so a run saved on N ranks
resumes or loads on any other number of ranks. The batches of step ``s`` depend on ``(seed, s, rank)``
only, so a resumed run takes the batches an uninterrupted one would.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from regattn.data.text import ByteTokenizer, TextCorpus, stdlib_corpus
from regattn.models.baselines import BASELINES
from regattn.models.lm import LM_MIXERS, DecoderLM, LMArchitecture, LMConfig, build_lm_mixer
from regattn.train import checks
from regattn.train.batches import to_device
from regattn.train.checkpoints import load_folder
from regattn.train.optim import OPTIMIZERS, apply_schedule, build_optimizer
from regattn.train.progress import Progress, Throughput
from regattn.train.schedules import SCHEDULES, lr_factor, wd_factor
from regattn.usage import UsageError


@dataclass
class LMTrainConfig(LMArchitecture):
    """Everything an LM run depends on.

    Model: the :class:`regattn.models.lm.LMArchitecture` fields (mixer: a name, or a list with one per
    layer; dim, layers, heads, kv_heads, head_dim, ffn, window, mixer_options per mixer name), and
    activation_checkpointing.
    Data: seq_len, batch_size (per rank), max_bytes (corpus cap; None = all), eval_tokens (validation
    tokens scored per evaluation).
    Optimisation: optimizer ("muon" | "adamw"), lr (peak; Muon's rate for the hidden matrices),
    weight_decay, wda_gamma (weight-decay annealing exponent, eq. 42; 0 = off), clip, schedule
    ("wsd" | "cosine" | "constant"), warmup / decay_start (fractions; None = the schedule's default),
    steps, eval_every (0 = at the end only), log_every.
    Run: seed, device ("auto"), amp (bf16 autocast on CUDA), compile ("none", or "default": ``torch.compile``
    of the model's forward and loss; CUDA-graph modes would overwrite the losses kept until a log point),
    checkpoint (a folder; resumed from when it holds one), checkpoint_every (0 = at the end only),
    sample_tokens (greedy text after training, single process only), progress (a progress bar on stderr,
    updated every log_every steps).
    """
    activation_checkpointing: bool = False
    seq_len: int = 256
    batch_size: int = 16
    max_bytes: int | None = None
    eval_tokens: int = 65536
    optimizer: str = "muon"
    lr: float = 0.02
    weight_decay: float = 0.1
    wda_gamma: float = 0.0
    clip: float = 1.0
    schedule: str = "wsd"
    warmup: float | None = None
    decay_start: float | None = None
    steps: int = 1000
    eval_every: int = 0
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    amp: bool = True
    compile: str = "none"
    checkpoint: str | None = None
    checkpoint_every: int = 0
    sample_tokens: int = 0
    progress: bool = True


LM_COMPILE_MODES = ("none", "default")


# ---------------------------------------------------------------------------------------------- process
@dataclass
class Runtime:
    """Rank, world size and device of this process (``world == 1`` without torch.distributed)."""
    rank: int
    world: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_runtime(device: str = "auto") -> Runtime:
    """Join the process group when launched with ``WORLD_SIZE > 1`` (torchrun); pick the device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return Runtime(rank, world, torch.device("cuda", local))
    return Runtime(rank, world, torch.device("cpu" if device == "auto" else device))


def all_sum(values: list[float], rt: Runtime) -> list[float]:
    """Sum float64 ``values`` over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=rt.device)
    if rt.distributed:
        dist.all_reduce(t)
    return t.tolist()


# ---------------------------------------------------------------------------------------------- model
def model_config(config: LMTrainConfig, vocab_size: int) -> LMConfig:
    architecture = {f.name: getattr(config, f.name) for f in dataclasses.fields(LMArchitecture)}
    architecture["mixer_options"] = dict(config.mixer_options)
    return LMConfig(vocab_size=vocab_size, checkpointing=config.activation_checkpointing, **architecture)


def build_model(config: LMTrainConfig, rt: Runtime, vocab_size: int = ByteTokenizer.vocab_size) -> DecoderLM:
    """The seeded model on ``rt.device``; with several ranks, each block and then the root sharded by FSDP2;
    compiled in place with ``config.compile == "default"`` (the state dict keeps its keys)."""
    torch.manual_seed(config.seed)
    model = DecoderLM(model_config(config, vocab_size)).to(rt.device)
    if rt.distributed:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    if config.compile == "default":
        model.compile(dynamic=False)
    return model


def autocast(rt: Runtime, amp: bool):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp and rt.device.type == "cuda")


# ---------------------------------------------------------------------------------------------- data
def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The batch generator of ``(seed, step, rank)``."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1009 + rank) % (2 ** 63))


def train_batch(corpus: TextCorpus, config: LMTrainConfig, step: int, rank: int):
    """``(inputs, targets)`` of ``rank`` at ``step``: ``batch_size`` random training windows."""
    return corpus.batch("train", config.batch_size, config.seq_len, step_generator(config.seed, step, rank))


@torch.no_grad()
def perplexity(model, corpus: TextCorpus, config: LMTrainConfig, rt: Runtime) -> dict:
    """Validation NLL per token, perplexity ``exp(NLL)`` and bits per byte ``NLL / ln 2`` over fixed
    windows of ``seq_len`` tokens.

    The windows (as many as fit ``eval_tokens``, rounded down to a multiple of the world size) are split
    over the ranks; every rank runs the same number of batches.
    """
    x, y = corpus.windows("val", config.seq_len, config.eval_tokens)
    n = len(x) - len(x) % rt.world
    if n == 0:
        raise ValueError(f"eval_tokens: expected at least world_size * seq_len = {rt.world * config.seq_len} "
                         f"validation tokens, got {len(x) * config.seq_len}")
    x, y = x[rt.rank:n:rt.world], y[rt.rank:n:rt.world]
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    for i in range(0, len(x), config.batch_size):
        xb, yb = x[i: i + config.batch_size].to(rt.device), y[i: i + config.batch_size].to(rt.device)
        with autocast(rt, config.amp):
            loss = model(xb, yb)
        nll += loss.double().item() * yb.numel()
        count += yb.numel()
    model.train(was_training)
    nll, count = all_sum([nll, count], rt)
    mean = nll / count
    return {"nll": mean, "ppl": math.exp(mean), "bits_per_byte": mean / math.log(2), "tokens": int(count)}


# ---------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: str, model, optimizer, meta: dict, rt: Runtime) -> None:
    """Model and optimizer (sharded, through torch.distributed.checkpoint) and ``meta.json`` under ``path``."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer.optimizers)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, overwrite=True), no_dist=not rt.distributed)
    if rt.main:
        with open(os.path.join(path, "meta.json.tmp"), "w") as f:
            json.dump(meta, f)
        os.replace(os.path.join(path, "meta.json.tmp"), os.path.join(path, "meta.json"))
    if rt.distributed:
        dist.barrier()


def load_checkpoint(path: str, model, optimizer=None) -> dict:
    """Load a checkpoint folder into ``model`` (and ``optimizer``) whatever the number of ranks that
    saved it, as data (:func:`regattn.train.checkpoints.load_folder`); returns its meta (step, history, config)."""
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer.optimizers)
    load_folder(state, path, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer.optimizers, state["optim"])
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def full_state_dict(model) -> dict:
    """The whole model's parameters as plain CPU tensors (gathered from the shards under FSDP2)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def has_checkpoint(path: str | None) -> bool:
    return bool(path) and os.path.exists(os.path.join(path, "meta.json"))


# ---------------------------------------------------------------------------------------------- training
def train_step(model, opt, config: LMTrainConfig, corpus: TextCorpus, step: int,
               rt: Runtime) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step at ``step`` (schedule, this rank's batch, clipping); returns the detached loss and
    whether the step was skipped (a float flag on the device): a non-finite loss (on any rank) or gradient
    norm makes no update, decided on the device with no host read (``opt`` fused, as :func:`train_lm` builds
    it: see :meth:`regattn.train.optim.Optimizers.step`)."""
    sched = dict(warmup=config.warmup, decay_start=config.decay_start)
    apply_schedule(opt, lr_factor(config.schedule, step, config.steps, **sched),
                   wd_factor(config.schedule, step, config.steps, gamma=config.wda_gamma, **sched))
    x, y = (to_device(t, rt.device) for t in train_batch(corpus, config, step, rt.rank))
    with autocast(rt, config.amp):
        loss = model(x, y)
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip if config.clip > 0 else math.inf)
    if isinstance(norm, DTensor):  # sharded parameters: the global norm, replicated
        norm = norm.full_tensor()
    bad = (~(torch.isfinite(loss) & torch.isfinite(norm))).float()
    if rt.distributed:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    opt.step(found_inf=bad)
    return loss.detach(), bad


def interval_loss(pending: list[tuple[torch.Tensor, torch.Tensor]], rt: Runtime) -> tuple[float, int]:
    """``(mean loss over the finite steps, steps skipped)`` of a log interval over every rank, read back at the
    log point; the mean is NaN when every step was skipped."""
    losses, bad = (torch.stack(x).double() for x in zip(*pending))
    total, skipped = all_sum(torch.stack([torch.where(bad > 0, 0.0, losses).sum(), bad.sum()]).tolist(), rt)
    skipped = int(round(skipped / rt.world))
    finite = len(pending) - skipped
    return (total / rt.world / finite if finite else math.nan), skipped


def train_lm(config: LMTrainConfig, *, corpus: TextCorpus | None = None, stop_at: int | None = None,
             log=print) -> dict:
    """Run (or resume) LM training; returns config, corpus info, world size and batch per rank, history,
    final perplexity, ``loaded`` (a resumed run: the step and validation perplexity of the checkpoint as
    loaded on these ranks; None otherwise), throughput (``tokens_per_second``: all ranks' tokens per
    second of optimizer steps, see :func:`steady_rate`), peak memory per rank (:func:`peak_memory_mib`),
    ``skipped_steps`` (steps whose loss or gradient norm was not finite: no update, see :func:`train_step`;
    each training row counts its own) and the model.

    stop_at: leave after that many steps in total (a checkpoint, when set, is written there).
    The progress bar shows the latest training loss and validation perplexity; without it (``progress``
    off) ``log`` gets them as lines.
    """
    if config.compile not in LM_COMPILE_MODES:
        raise ValueError(f"compile: expected one of {LM_COMPILE_MODES}, got {config.compile!r}")
    rt = setup_runtime(config.device)
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    corpus = corpus or stdlib_corpus(config.max_bytes)
    model = build_model(config, rt)
    opt = build_optimizer(model, config.optimizer, lr=config.lr, weight_decay=config.weight_decay, fused=True)
    step, history, loaded = 0, {"train": [], "eval": []}, None
    if has_checkpoint(config.checkpoint):
        meta = load_checkpoint(config.checkpoint, model, opt)
        step, history = meta["step"], meta["history"]
        loaded = {"step": step, **perplexity(model, corpus, config, rt)}
        if rt.main and not config.progress:
            log(f"resumed at step {step}: val nll {loaded['nll']:.4f}")
    end = config.steps if stop_at is None else min(stop_at, config.steps)
    tokens_per_step = config.batch_size * config.seq_len * rt.world
    pending, rates = [], []             # the losses of the current log interval; tokens/s of each interval
    clock = Throughput(sync=torch.cuda.synchronize if rt.device.type == "cuda" else None)
    name = config.mixer if isinstance(config.mixer, str) else "-".join(config.mixer)
    bar = Progress(config.steps, start=step, enabled=config.progress and rt.main, label=f"lm/{name}")
    model.train()
    clock.mark(step)
    while step < end:
        pending.append(train_step(model, opt, config, corpus, step, rt))
        step += 1
        if step % config.log_every == 0 or step == end:
            mean, skipped = interval_loss(pending, rt)
            rates.append(tokens_per_step * clock.mark(step))
            history["train"].append({"step": step, "loss": mean, "lr": opt.param_groups[0]["lr"],
                                     "tokens_per_second": rates[-1], "skipped": skipped})
            pending = []
            ppl = {"val_ppl": history["eval"][-1]["ppl"]} if history["eval"] else {}
            bar.update(step, loss=mean, tok_s=rates[-1], **ppl)
            if rt.main and not config.progress:
                log(f"step {step}/{config.steps} loss {mean:.4f} ({rates[-1]:.0f} tok/s)"
                    + (f", {skipped} step(s) skipped: non-finite loss or gradient" if skipped else ""))
        evaluate_now = (config.eval_every and step % config.eval_every == 0) or step == config.steps
        checkpoint_now = config.checkpoint and ((config.checkpoint_every and step % config.checkpoint_every == 0)
                                                or step == end)
        if evaluate_now or checkpoint_now:
            with clock.paused():
                if evaluate_now:
                    history["eval"].append({"step": step, **perplexity(model, corpus, config, rt)})
                    if rt.main and not config.progress:
                        log(f"step {step} val nll {history['eval'][-1]['nll']:.4f} "
                            f"ppl {history['eval'][-1]['ppl']:.3f}")
                if checkpoint_now:
                    save_checkpoint(config.checkpoint, model, opt,
                                    dict(step=step, history=history, config=dataclasses.asdict(config)), rt)
    bar.close()
    result = dict(config=dataclasses.asdict(config), corpus=corpus.info, metric="ppl", world_size=rt.world,
                  batch_size_per_rank=config.batch_size, rank=rt.rank, device=str(rt.device),
                  parameters=sum(p.numel() for p in model.parameters()), steps=step, history=history,
                  final=history["eval"][-1] if history["eval"] else None, loaded=loaded,
                  tokens_per_second=steady_rate(rates), peak_memory_mib=peak_memory_mib(rt),
                  skipped_steps=sum(row.get("skipped", 0) for row in history["train"]), model=model)
    if config.sample_tokens and not rt.distributed:
        result["sample"] = sample_text(model, corpus, config.sample_tokens, rt)
    return result


def steady_rate(rates: list[float]) -> float | None:
    """The median training throughput over the log intervals, leaving out the first (warm-up, compilation)
    when there are others; None when no step ran."""
    rates = rates[1:] if len(rates) > 1 else rates
    return statistics.median(rates) if rates else None


def peak_memory_mib(rt: Runtime) -> list[float] | None:
    """Each rank's peak CUDA memory held by tensors since the run began (``torch.cuda.max_memory_allocated``),
    in MiB, in rank order; None on the CPU."""
    if rt.device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(rt.device) / 2 ** 20], dtype=torch.float64, device=rt.device)
    peaks = [peak]
    if rt.distributed:
        peaks = [torch.empty_like(peak) for _ in range(rt.world)]
        dist.all_gather(peaks, peak)
    return torch.cat(peaks).tolist()


def sample_text(model: DecoderLM, corpus: TextCorpus, n: int, rt: Runtime, prompt_len: int = 64) -> dict:
    """Greedy continuation of the first ``prompt_len`` validation bytes: ``{"prompt", "continuation"}``."""
    tok = ByteTokenizer()
    prompt = corpus.val[:prompt_len][None].to(rt.device)
    out = model.generate(prompt, n)
    return {"prompt": tok.decode(prompt[0]), "continuation": tok.decode(out[0, prompt_len:])}


# ---------------------------------------------------------------------------------------------- command
def parse_args(argv=None) -> tuple[LMTrainConfig, argparse.Namespace]:
    d = LMTrainConfig()
    p = argparse.ArgumentParser(prog="python -m regattn.train lm", description=__doc__.split("\n")[0])
    p.add_argument("--mixer", default=d.mixer,
                   help=f"one of {', '.join(LM_MIXERS + BASELINES)}; or a comma-separated list, one per layer")
    for name in ("dim", "layers", "heads", "seq_len", "batch_size", "steps", "eval_every", "log_every", "seed",
                 "checkpoint_every", "eval_tokens", "sample_tokens"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("kv_heads", "head_dim", "ffn", "window", "max_bytes"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    for name in ("lr", "weight_decay", "wda_gamma", "clip"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--warmup", type=float, default=None)
    p.add_argument("--decay-start", type=float, default=None)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer)
    p.add_argument("--schedule", choices=SCHEDULES, default=d.schedule)
    p.add_argument("--compare", default=None, help="comma-separated mixers: one run each (all layers), and a plot")
    p.add_argument("--mixer-options", default="{}", help='JSON per mixer name, e.g. \'{"lla": {"cg_iters": 4}}\'')
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--compile", choices=LM_COMPILE_MODES, default=d.compile,
                   help="torch.compile the model's forward and loss with this mode (default none)")
    p.add_argument("--checkpoint", default=None, help="checkpoint folder (resumed from when it holds one)")
    p.add_argument("--stop-at", type=int, default=None,
                   help="leave after this many steps in total, the schedule still that of --steps (with "
                        "--checkpoint: to resume later)")
    p.add_argument("--out", default="out/lm", help="folder for the JSON results and the curves plot")
    p.add_argument("--quiet", action="store_true", help="no progress bar: a line per log point instead")
    args = p.parse_args(argv)
    mixer = args.mixer.split(",") if "," in args.mixer else args.mixer
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(LMTrainConfig) if hasattr(args, f.name)}
    fields.update(mixer=mixer, mixer_options=parse_mixer_options(args.mixer_options), amp=not args.no_amp,
                  progress=not args.quiet)
    config = LMTrainConfig(**fields)
    check_config(config)
    if args.stop_at is not None:
        checks.at_least("--stop-at", args.stop_at, 1)
    for name in args.compare.split(",") if args.compare else []:
        check_model(dataclasses.replace(config, mixer=name), "--compare")
    return config, args


def parse_mixer_options(text: str) -> dict:
    """``--mixer-options``: a JSON object of objects, one per mixer name."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--mixer-options: not JSON ({e}): {text!r}") from None
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise UsageError(f'--mixer-options: expected an object per mixer name, e.g. {{"lla": {{"cg_iters": 4}}}}, '
                         f"got {text!r}")
    return options


def check_config(config: LMTrainConfig) -> None:
    """The command line's values, before anything is built or read."""
    for name in ("dim", "layers", "heads", "seq_len", "batch_size", "steps", "log_every"):
        checks.at_least(flag(name), getattr(config, name), 1)
    for name in ("eval_every", "checkpoint_every", "sample_tokens", "seed"):
        checks.at_least(flag(name), getattr(config, name), 0)
    for name in ("kv_heads", "head_dim", "ffn", "window", "max_bytes"):
        if getattr(config, name) is not None:
            checks.at_least(flag(name), getattr(config, name), 1)
    checks.at_least("--eval-tokens", config.eval_tokens, config.seq_len)
    checks.positive("--lr", config.lr)
    for name in ("weight_decay", "wda_gamma", "clip"):
        checks.non_negative(flag(name), getattr(config, name))
    checks.fraction("--warmup", config.warmup)
    checks.fraction("--decay-start", config.decay_start)
    checks.device("--device", config.device)
    check_model(config, "--mixer")


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def check_model(config: LMTrainConfig, mixer_flag: str) -> None:
    """Build each mixer of the model once on the CPU: a bad name, size or option is a usage error (the
    message names the field, e.g. ``--mixer: kv_heads: expected a divisor of heads = 4, got 3``)."""
    lm_config = model_config(config, ByteTokenizer.vocab_size)
    try:
        for name in dict.fromkeys(lm_config.mixers()):
            build_lm_mixer(name, lm_config)
    except TypeError as e:
        raise UsageError(f"--mixer-options: {e}") from None
    except (ValueError, ImportError) as e:
        raise UsageError(f"{mixer_flag}: {e}") from None


def report(result: dict, out: str, name: str) -> str:
    """Write ``result`` (without the model) to ``out/lm-NAME-worldN.json``; print its summary; the path."""
    path = os.path.join(out, f"lm-{name}-world{result['world_size']}.json")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump({k: v for k, v in result.items() if k != "model"}, f, indent=1)
    if result["final"]:
        rate = result["tokens_per_second"]
        peak = result["peak_memory_mib"]
        print(f"{name}: val ppl {result['final']['ppl']:.3f} ({'-' if rate is None else f'{rate:.0f}'} tok/s, "
              f"{result['parameters']} parameters, {result['world_size']} rank(s)"
              f"{'' if peak is None else f', peak {max(peak):.0f} MiB a rank'})")
    if "sample" in result:
        print(result["sample"]["prompt"] + "|" + result["sample"]["continuation"])
    print(f"wrote {path}")
    return path


def main(argv=None) -> int:
    """One run, or with ``--compare a,b,c`` one run per mixer (each in every layer); the curves plot."""
    config, args = parse_args(argv)
    names = args.compare.split(",") if args.compare else [config.mixer]
    results, result, corpus = {}, None, stdlib_corpus(config.max_bytes)
    for mixer in names:
        run = dataclasses.replace(config, mixer=mixer)
        if args.compare and config.checkpoint:
            run = dataclasses.replace(run, checkpoint=os.path.join(config.checkpoint, mixer))
        result = train_lm(run, corpus=corpus, stop_at=args.stop_at)
        result.pop("model")
        name = mixer if isinstance(mixer, str) else "-".join(mixer)
        results[name] = result
        if result["rank"] == 0:
            report(result, args.out, name)
    if result["rank"] == 0:
        from regattn.train.plots import plot_curves
        stem = "compare" if args.compare else next(iter(results))
        path = os.path.join(args.out, f"lm-{stem}-world{result['world_size']}-curves.png")
        plot_curves({name: [r] for name, r in results.items()}, path, title="byte-level LM, validation perplexity")
        print(f"wrote {path}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
