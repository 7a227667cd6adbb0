"""Session over a built artifact: paged cache pools and block tables (block 0 = null block), KDA states, ragged
batches, greedy or seeded sampling, text through the artifact's tokenizer.

Limits (the artifact's capacity, the same on every backend; `inspect` shows them): export.max_seq_len is the most
tokens one sequence holds (prompt + generated), export.max_batch the most sequences in one cache or generate call.
TensorRT engines are built for exactly these (their optimization profile), the other backends enforce them here; a
request beyond either is refused with the numbers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kimi_compile.artifact import ArtifactError, load_manifest
from kimi_compile.paged import BlockAllocator, CacheCapacityError


class RuntimeInputError(ValueError):
    pass


class CacheState:
    """Cache tensors of one batch, laid out as the graphs' cache inputs (`manifest["runtime"]["caches"]`), with the
    shared paged block allocator (kimi_compile.paged) for block tables and lengths."""

    def __init__(self, caches: list[dict], batch_size: int, max_seq_len: int, block_size: int,
                 num_blocks: int | None = None, *, rows: int | None = None, zeros=None):
        """`rows` >= batch_size: the batch the graphs see (an executor's batch bucket; extra rows are padding that
        holds no tokens); `zeros(shape, dtype)` allocates the tensors where the executor wants them (default numpy)."""
        rows = rows or batch_size
        self.blocks = BlockAllocator(rows, max_seq_len, block_size, num_blocks)
        self.batch_size, self.rows, self.block_size = batch_size, rows, block_size
        self.names = [c["name"] for c in caches]
        self.tensors: dict = {}
        for c in caches:
            shape = [rows if d == "batch" else self.blocks.num_blocks if d == "num_blocks" else d for d in c["shape"]]
            self.tensors[c["name"]] = zeros(shape, c["dtype"]) if zeros else np.zeros(shape, dtype=np.dtype(c["dtype"]))

    @property
    def block_table(self) -> np.ndarray:
        return self.blocks.block_table

    @property
    def seq_lens(self) -> np.ndarray:
        return self.blocks.seq_lens

    @seq_lens.setter
    def seq_lens(self, value: np.ndarray) -> None:
        self.blocks.seq_lens = np.asarray(value, dtype=np.int64)

    def reserve(self, new_lens: np.ndarray) -> None:
        try:
            self.blocks.reserve(new_lens)
        except CacheCapacityError as e:
            raise RuntimeInputError(str(e)) from None

    @property
    def bytes(self) -> int:
        return sum(int(np.prod(t.shape)) * t.itemsize if hasattr(t, "itemsize") else t.nbytes
                   for t in self.tensors.values())


class Session:
    """Generation over one executor (`run(phase, feeds) -> outputs`) whose graphs follow the runtime contract in
    `runtime` (block_size, vocab_size, eos_token_id, max_seq_len, caches); `load(artifact_dir)` builds one from an
    artifact, other callers (the accuracy report) from in-memory graphs."""

    def __init__(self, executor, runtime: dict, *, manifest: dict | None = None):
        self.backend = executor
        self.runtime = runtime
        self.manifest = manifest or {}
        self.block_size = int(runtime["block_size"])
        self.vocab_size = int(runtime["vocab_size"])
        self.eos_token_id = runtime.get("eos_token_id")
        self.tokenizer = None  # kimi_compile.tokenizer.Tokenizer when the artifact ships one (load sets it)

    @staticmethod
    def open_artifact(artifact_dir: str | Path) -> Session:
        """Another artifact (a speculative draft model), loaded as `load` loads one."""
        return load(artifact_dir)

    @property
    def max_seq_len(self) -> int:
        return int(self.runtime["max_seq_len"])

    @property
    def max_batch(self) -> int | None:
        value = self.runtime.get("max_batch")
        return int(value) if value else None

    def encode_text(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of `text` (with `chat`, wrapped as one user message in the checkpoint's chat template)."""
        if self.tokenizer is None:
            raise RuntimeInputError("this artifact has no tokenizer (its checkpoint shipped no tokenizer.json or "
                                    "tiktoken.model): give token ids, or build with --model DIR of a checkpoint "
                                    "that has one")
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        ids = self.tokenizer.encode(text)
        if not ids:
            raise RuntimeInputError(f"prompt {text!r} encodes to no tokens")
        return ids

    def decode_text(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise RuntimeInputError("this artifact has no tokenizer: it returns token ids only")
        return self.tokenizer.decode(ids)

    def new_cache(self, batch_size: int, max_seq_len: int | None = None) -> CacheState:
        """A cache for `batch_size` sequences (limit: export.max_batch) of up to `max_seq_len` tokens (default and
        limit: the artifact's export.max_seq_len). Executors with static shapes (graph capture) get the full capacity
        and their batch bucket, so one captured graph serves every request of that bucket."""
        if self.max_batch is not None and batch_size > self.max_batch:
            raise RuntimeInputError(f"batch: {batch_size} sequences exceed this artifact's export.max_batch "
                                    f"({self.max_batch}); split the batch or rebuild with a larger export.max_batch")
        limit = self.max_seq_len
        if max_seq_len is not None and max_seq_len > limit:
            raise RuntimeInputError(f"max_seq_len: {max_seq_len} tokens exceed this artifact's export.max_seq_len "
                                    f"({limit}); rebuild with a larger export.max_seq_len")
        static = getattr(self.backend, "static_shapes", False)
        rows = self.backend.batch_bucket(batch_size) if hasattr(self.backend, "batch_bucket") else batch_size
        return CacheState(self.runtime["caches"], batch_size, limit if static or max_seq_len is None else max_seq_len,
                          self.block_size, rows=rows, zeros=getattr(self.backend, "zeros", None))

    def _check_ids(self, rows: Sequence[Sequence[int]]) -> None:
        for b, r in enumerate(rows):
            for t in r:
                if not (isinstance(t, (int, np.integer)) and 0 <= int(t) < self.vocab_size):
                    raise RuntimeInputError(f"prompt {b}: token id {t!r} is not in 0..{self.vocab_size - 1}")

    def _run(self, phase: str, ids: np.ndarray, lens: np.ndarray, cache: CacheState, *, last: bool = False):
        """One graph step over the cache's rows (padding rows: no tokens); logits of the real rows ([B, T, vocab];
        with `last`, [B, vocab] at each row's last token of this step)."""
        B = ids.shape[0]
        if not last and phase == "prefill" and int((self.manifest.get("parallel") or {}).get("cp", 1)) > 1:
            raise RuntimeInputError("this artifact's prefill returns only each prompt's last-token logits (context "
                                    "parallel: parallel.cp > 1); use prefill_last or generate")
        if cache.rows > B:
            ids = np.concatenate([ids, np.zeros((cache.rows - B, ids.shape[1]), np.int64)])
            lens = np.concatenate([lens, np.zeros(cache.rows - B, np.int64)])
        cache.reserve(cache.seq_lens + lens)
        feeds = {"input_ids": ids.astype(np.int64), "start": cache.seq_lens.copy(), "lengths": lens.astype(np.int64),
                 "block_table": cache.block_table, **cache.tensors}
        out = self.backend.run(phase, feeds)
        for name in cache.names:
            cache.tensors[name] = out[name + ".out"]
        cache.seq_lens = cache.seq_lens + lens
        if "logits" not in out:  # the executor gave each row's last-token logits only (context-parallel prefill)
            return out["logits_last"][:B]
        logits = out["logits"][:B]
        if not last:
            return logits
        rows = [logits[b, max(int(lens[b]) - 1, 0)] for b in range(B)]
        return self.backend.stack(rows) if hasattr(self.backend, "stack") else np.stack(rows)

    def _host(self, x) -> np.ndarray:
        return self.backend.host(x) if hasattr(self.backend, "host") else np.asarray(x)

    def _check_prompts(self, prompts: Sequence[Sequence[int]], cache: CacheState) -> None:
        if len(prompts) != cache.batch_size:
            raise RuntimeInputError(f"prompts: {len(prompts)} given, cache holds {cache.batch_size} sequences")
        if any(len(p) == 0 for p in prompts):
            raise RuntimeInputError("prompts: every prompt needs at least one token")
        self._check_ids(prompts)

    def _prefill_rows(self, prompts: Sequence[Sequence[int]], offset: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [offset, offset + T) of every prompt as one padded step (T >= 2: the prefill graph's minimum)."""
        ids = np.zeros((len(prompts), max(T, 2)), dtype=np.int64)
        lens = np.zeros(len(prompts), dtype=np.int64)
        for b, p in enumerate(prompts):
            part = p[offset:offset + T]
            ids[b, : len(part)] = part
            lens[b] = len(part)
        return ids, lens

    def prefill(self, prompts: Sequence[Sequence[int]], cache: CacheState) -> np.ndarray:
        """Append B prompts (any lengths >= 1) to the cache in one step; returns all logits [B, T, vocab] (rows past
        a prompt's length are padding)."""
        self._check_prompts(prompts, cache)
        T = max(len(p) for p in prompts)
        ids, lens = self._prefill_rows(prompts, 0, T)
        return self._host(self._run("prefill", ids, lens, cache)[:, :T])

    def prefill_last(self, prompts: Sequence[Sequence[int]], cache: CacheState):
        """Append B prompts in chunks of the artifact's export.prefill_chunk tokens; returns the logits of each
        prompt's last token [B, vocab] (where the executor keeps them: on the device for cuda)."""
        self._check_prompts(prompts, cache)
        chunk = int(self.runtime.get("prefill_chunk") or max(len(p) for p in prompts))
        T = max(len(p) for p in prompts)
        last: list = [None] * len(prompts)
        for off in range(0, T, chunk):
            ids, lens = self._prefill_rows(prompts, off, min(chunk, T - off))
            rows = self._run("prefill", ids, lens, cache, last=True)
            for b, p in enumerate(prompts):
                if off < len(p) <= off + chunk:
                    last[b] = rows[b]
        return self.backend.stack(last) if hasattr(self.backend, "stack") else np.stack(last)

    def decode(self, tokens: Sequence[int], cache: CacheState) -> np.ndarray:
        """One token per sequence -> logits [B, vocab]."""
        return self._host(self._decode(tokens, cache))

    def _decode(self, tokens: Sequence[int], cache: CacheState):
        self._check_ids([tokens])
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        return self._run("decode", ids, np.ones(ids.shape[0], dtype=np.int64), cache)[:, 0]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, seed: int | None = None, stop_at_eos: bool = True,
                 speculative=None) -> list[list[int]]:
        """Greedy (temperature 0) or seeded sampling for a batch of prompts of different lengths. A request longer
        than the artifact's export.max_seq_len (prompt + new tokens) is refused with the numbers. `speculative`
        ({"method": "ngram", "k": 4}, or "ngram:4"): speculative decoding (runtime/speculative.py), same output
        distribution; the returned list then carries per-request acceptance `stats`."""
        if max_new_tokens < 0:
            raise RuntimeInputError(f"max_new_tokens: expected >= 0, got {max_new_tokens}")
        prompts = [list(p) for p in prompts]
        if not prompts:
            raise RuntimeInputError("prompts: expected at least one prompt")
        need = max(len(p) for p in prompts) + max_new_tokens
        if need > self.max_seq_len:
            raise RuntimeInputError(f"prompt + max_new_tokens = {need} tokens exceed this artifact's "
                                    f"export.max_seq_len ({self.max_seq_len})")
        if speculative:
            from kimi_compile.runtime.speculative import generate as speculative_generate

            return speculative_generate(self, prompts, max_new_tokens, speculative, temperature=temperature,
                                        top_k=top_k, seed=seed, stop_at_eos=stop_at_eos)
        cache = self.new_cache(len(prompts), need)
        rng = np.random.default_rng(seed)
        last = self.prefill_last(prompts, cache)
        out: list[list[int]] = [[] for _ in prompts]
        done = np.zeros(len(prompts), dtype=bool)
        for step in range(max_new_tokens):
            nxt = self._pick(last, temperature, top_k, rng)
            for b in range(len(prompts)):
                if not done[b]:
                    out[b].append(int(nxt[b]))
                    if stop_at_eos and self.eos_token_id is not None and nxt[b] == self.eos_token_id:
                        done[b] = True
            if done.all() or step == max_new_tokens - 1:
                break
            last = self._decode(nxt.tolist(), cache)
        return out

    def _pick(self, logits, temperature: float, top_k: int | None, rng: np.random.Generator) -> np.ndarray:
        if temperature <= 0:  # argmax where the logits are (no [B, vocab] copy to the host)
            return np.asarray(self._host(logits.argmax(-1))).astype(np.int64)
        return _sample(self._host(logits), temperature, top_k, rng)


def _sample(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(z, axis=-1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p])


def load(artifact_dir: str | Path, threads: int | None = None, providers: Sequence[str] | None = None) -> Session:
    """Open an artifact: check its manifest and every file's hash, then start the executor its backend names.
    `providers` (onnxruntime artifacts): execution providers in order of preference, e.g. ["cuda", "cpu"]."""
    from kimi_compile import backends
    from kimi_compile.tokenizer import load_tokenizer

    root = Path(artifact_dir)
    manifest = load_manifest(root)
    rt = manifest.get("runtime")
    if not isinstance(rt, dict):
        raise ArtifactError(root, "manifest has no 'runtime' section", "manifest.json")
    options = {"providers": list(providers)} if providers is not None else {}
    if options and manifest["backend"]["name"] != "onnxruntime":
        raise RuntimeInputError(f"providers: apply to onnxruntime artifacts; {root} is built for the "
                                f"{manifest['backend']['name']} backend")
    backend = backends.get(manifest["backend"]["name"])
    if int((manifest.get("parallel") or {}).get("world", 1)) > 1:  # a partitioned artifact: this process is one rank
        if not hasattr(backend, "init_distributed"):
            raise RuntimeInputError(f"{root} is partitioned for {manifest['parallel']['world']} ranks; backend "
                                    f"{manifest['backend']['name']!r} runs one rank (partitioned artifacts run on "
                                    "the cuda backend)")
        options.update(backend.init_distributed(manifest))
    executor = backend.load(root, manifest, threads=threads, **options)
    sess = Session(executor, rt, manifest=manifest)
    sess.tokenizer = load_tokenizer(root, manifest)
    return sess
