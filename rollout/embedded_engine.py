"""The embedded CPU engine's core, without HTTP (`rollout/engine_server.py` serves it).
`device="cuda"` puts the model and its batches on a GPU instead (the GPU checks' colocated
engine: it takes weights by CUDA IPC handles or from disk; the broadcast receive path
allocates on the host, gloo only).

Generation: requests that arrive while a batch runs are queued and batched together (up to
`max_batch_size`); a batch is left-padded, prefilled once, then decoded token by token with
a KV cache; finished rows are dropped from the cache as they finish. Logprobs: each output
token's log-probability under the distribution it was sampled from, log_softmax(logits /
temperature), *before* top-k / top-p truncation (greedy: log_softmax(logits)). Each output
token records the weight version it was sampled under: an answer whose tokens span a weight
update (the engine paused in place, new weights loaded, resumed: its KV cache of the earlier
tokens kept) carries them (`Completion.token_versions`). Sampling is seedable per request
(`SamplingParams.sampling_seed`, any 64-bit integer). Invalid requests raise `BadRequest`
(the HTTP layer checks each request's fields first: rollout/engine_requests.py). A batch
that fails anyway is run again one request at a time, so a request that fails fails alone
(`GenerationFailed`, its traceback logged) and the requests batched with it get their
results.

Vision-language models (config.json with a `vision_config`: transformers'
AutoModelForImageTextToText and the model's image processor): a request may carry
images (`prepare_images`: SGLang's `image_data` data URLs, one per image pad of its
ids); the engine expands each pad to its image's token count (`prompt_tokens` counts the
expanded ids, as SGLang's), prefills the batch with the rows' `pixel_values` and
`image_grid_thw` and explicit multimodal RoPE positions (rollout/vision.py; so no
`rope_deltas` state of the model is used or kept between batches), then decodes each row
from its largest position + 1. Weight updates take the checkpoints' names
(`engine_weights.vision_weight_view`).
"""

from __future__ import annotations

import inspect
import json
import logging
import queue
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rollout.engine_guard import generation_problem
from rollout.engine_lora import AdapterProblem, EngineAdapters, read_peft_dir
from rollout.engine_memory import free_parameters, memory_tags, reallocate_parameters, released_problem
from rollout.engine_weights import (
    checkpoint_tensors,
    receive_flat_bucket,
    receive_per_tensor,
    receive_tensors,
    vision_weight_view,
    weight_view,
)
from rollout.fp8_blocks import DEFAULT_BLOCK, Fp8Pairs, fp8_block_size, scale_shape, weight_name_of
from rollout.routed_experts import RouteRecorder, is_moe
from rollout.token_sampler import sample_tokens, token_uniforms
from rollout.vision import (
    ImageTokenMismatch,
    decode_image_data,
    expand_image_pads,
    image_token_counts,
    is_vision_model,
    load_image_processor,
    merge_size,
    mrope_positions,
    process_images,
)
from rollout.weight_group import (
    destroy_weight_update_group,
    dtype_from_name,
    init_weight_update_group,
    tensor_nbytes,
    weight_checksum,
)
from rollout.weight_tensors import deserialize_named_tensors

log = logging.getLogger("rollout.embedded_engine")

DEFAULT_GROUP = "weight_update_group"
_ABORT_MESSAGE = "generation paused with mode=abort"


class BadRequest(Exception):
    """An invalid request (HTTP 400). `field`: the request field at fault, when one is."""

    def __init__(self, message, field: str | None = None):
        super().__init__(str(message))
        self.field = field

    def __reduce__(self):  # across engine_ranks' pipes, with its field
        return type(self), (str(self), self.field)


class GenerationFailed(RuntimeError):
    """A request failed inside the engine's batching worker (an engine fault, HTTP 500);
    the traceback is in the engine's log, not in the message."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling (SGLang's `sampling_params`, parsed)."""

    temperature: float = 1.0  # <= 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None  # None: a fresh random seed; any integer, taken modulo 2**64


@dataclass
class Completion:
    """One finished request."""

    rid: str
    text: str
    output_ids: list[int]
    logprobs: list[float]  # one per output token
    finish_reason: dict  # {"type": "stop"|"length"|"abort", ...} as SGLang reports it
    prompt_tokens: int
    weight_version: str
    rank: int = 0  # the engine rank that served it (engine_ranks.RankedEngine: 0..N-1)
    # when asked (an MoE model): int32 [prompt_tokens + len(output_ids) - 1, layers, k], the
    # experts each fed token went to (rollout/routed_experts.py)
    routed_experts: np.ndarray | None = None
    # the weight version each output token was sampled under, when the request's tokens span
    # a weight update (a pause in place, then new weights); None: all `weight_version`
    token_versions: list[str] | None = None


@dataclass
class RequestImages:
    """One request's images, processed: expanded ids (each image pad repeated its token
    count) and what the model takes with them."""

    input_ids: list[int]
    pixel_values: torch.Tensor  # float32 [patches, dim]
    image_grid_thw: torch.Tensor  # long [images, 3]


@dataclass
class Request:
    input_ids: list[int]  # expanded, for a vision-language model's image request
    params: SamplingParams
    rid: str
    images: RequestImages | None = None
    positions: torch.Tensor | None = None  # a vision-language model's mrope positions [3, len]
    routed_experts: bool = False  # return the experts each fed token went to
    adapter: str | None = None  # the LoRA adapter it names (SGLang's lora_path); None: the base
    done: threading.Event = field(default_factory=threading.Event)
    result: Completion | None = None
    error: str | None = None  # why it failed inside the worker (no traceback: that is logged)


@dataclass
class _Row:
    """One request's decoding state."""

    req: Request
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: list[str]
    stop_ids: set[int]
    seed: int  # with the token's position, picks each sampled token (rollout/token_sampler.py)
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # the weight version of each output token
    finish: dict | None = None
    routes: list[np.ndarray] | None = None  # per forward, the fed tokens' [tokens, layers, k] expert ids


class Engine:
    """The model, the request queue and the batching worker; no HTTP."""
    ranks = 1  # weight-update group ranks it joins as (engine_ranks.RankedEngine: more)
    max_new_tokens_cap: int | None = None  # per request, beside the model's context; the server sets it

    def __init__(self, model_path: str, *, dtype: str = "float32", max_batch_size: int = 256,
                 device: str = "cpu"):
        from transformers import AutoTokenizer

        self.model_path = model_path
        self.dtype = dtype_from_name(dtype)
        self.device = torch.device(device)  # of the model and its batches
        self.released: set[str] = set()  # memory tags released (engine_memory.py)
        self.vision = is_vision_model(model_path)
        self.model, self.fp8 = self._load_model(model_path)
        self.routes = RouteRecorder(self.model) if is_moe(self.model) else None  # routed experts, when asked
        # the most a weight-update bucket that does not fit may announce and still be received
        # (so its sender never hangs): the model's own size
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.image_processor = load_image_processor(model_path) if self.vision else None
        self.image_pad_id = int(self.model.config.image_token_id) if self.vision else None
        self.context_length = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
        self.eos_ids = {int(e) for e in [*eos, self.tokenizer.eos_token_id] if e is not None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.max_batch_size = max_batch_size
        self.weight_version = "default"
        self.model_lock = threading.Lock()  # forward passes vs weight loads
        self.queue: queue.Queue[Request] = queue.Queue()
        self.pause_cv = threading.Condition()
        self.paused = False
        self.abort_epoch = 0  # bumped by pause(mode=abort): batches begun before it end aborted
        self.batch_epoch = 0  # abort_epoch when the worker took its current batch (its re-runs too)
        self.in_update = False
        # the model's state by name during an update, built by its first bucket: parameters
        # keep their objects (a bucket landing elsewhere, a release, re-point `.data`), and
        # building the state dict was half of the ~1 ms from an announcement to its receive
        self.update_state: dict[str, torch.Tensor] | None = None
        self.groups: dict[str, torch.distributed.ProcessGroup] = {}
        self.receive_scratch = torch.empty(0, dtype=torch.uint8)  # reused by buckets that cannot land in place
        self.freed: list = []  # the parameters "weights" freed, with their shapes
        self.adapters = EngineAdapters(self._weight_views)  # LoRA adapters by name (rollout/engine_lora.py)
        self.batch_running = False
        self.worker = threading.Thread(target=self._serve, name="engine-worker", daemon=True)
        self.worker.start()

    def _load_model(self, model_path: str):
        """The HF model, and the FP8 pairing of weight updates. A block-FP8 checkpoint
        (config.json's quantization_config, rollout/fp8_blocks.py) is built unquantized in
        the engine's dtype and loaded dequantized, as FP8 weight updates are."""
        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.from_pretrained(model_path)
        block = fp8_block_size(getattr(config, "quantization_config", None))
        fp8 = Fp8Pairs(block or DEFAULT_BLOCK)
        if block is None:
            model = self._model_class().from_pretrained(model_path, dtype=self.dtype)
            return model.to(self.device).eval(), fp8
        del config.quantization_config
        model = self._model_class().from_config(config, dtype=self.dtype).to(self.device).eval()
        try:
            model.generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:  # no generation_config.json: the model config's
            pass
        self.model, self.fp8 = model, fp8
        loaded = self._copy_in(checkpoint_tensors(model_path))
        missing = [n for n, p in model.named_parameters() if p.untyped_storage().data_ptr() not in loaded]
        if missing:
            raise ValueError(f"{model_path}: the FP8 checkpoint has no weights for {missing[:5]}")
        return model, fp8

    def _model_class(self):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        return AutoModelForImageTextToText if self.vision else AutoModelForCausalLM

    # -- generation --------------------------------------------------------------------
    def prepare_images(self, input_ids: list[int], image_data: list) -> RequestImages:
        """A request's images (SGLang's `image_data` of one request: data URLs, one per
        image pad of `input_ids`), decoded and processed; BadRequest naming the problem."""
        if not self.vision:
            raise BadRequest(f"image_data sent to {self.model_path}, a text model (its config.json has no "
                             "vision_config)")
        if not isinstance(image_data, list):
            raise BadRequest(f"image_data of one request must be a list of 'data:image/...;base64,' strings, "
                             f"got {type(image_data).__name__}")
        try:
            images = [decode_image_data(item) for item in image_data]
        except ValueError as err:
            raise BadRequest(f"image_data: {err}") from None
        ids = list(map(int, input_ids))
        if not images:
            return RequestImages(ids, None, None)  # type: ignore[arg-type]  (a text request)
        pixel_values, grid = process_images(self.image_processor, images)
        try:
            ids = expand_image_pads(ids, self.image_pad_id, image_token_counts(grid, merge_size(self.image_processor)))
        except ImageTokenMismatch as err:
            raise BadRequest(str(err)) from None
        return RequestImages(ids, pixel_values, grid)

    def submit(self, input_ids: list[int], params: SamplingParams, rid: str,
               images: RequestImages | None = None, routed_experts: bool = False,
               adapter: str | None = None) -> Request:
        """Queue one request. `images`: its `prepare_images` (then `input_ids` are unused:
        the images carry the expanded ids). `routed_experts`: return the experts each fed
        token went to (an MoE model). `adapter`: the loaded LoRA adapter it runs with."""
        if routed_experts and self.routes is None:
            raise BadRequest(f"return_routed_experts: {self.model_path} is not a mixture-of-experts model",
                             "return_routed_experts")
        if images is not None:
            input_ids = images.input_ids
            images = images if images.pixel_values is not None else None
        problem = released_problem(self.released) or generation_problem(input_ids, params.max_new_tokens,
                                     vocab_size=self.model.get_input_embeddings().weight.shape[0],
                                     context_length=self.context_length,
                                     max_new_tokens_cap=self.max_new_tokens_cap)
        if problem:
            raise BadRequest(problem)
        req = Request(list(map(int, input_ids)), params, rid, images, routed_experts=routed_experts, adapter=adapter)
        if self.vision:
            try:
                req.positions = mrope_positions(req.input_ids, self.image_pad_id,
                                                None if images is None else images.image_grid_thw,
                                                merge_size(self.image_processor))
            except ImageTokenMismatch as err:
                raise BadRequest(f"{err} (send each image in image_data, one image pad per image)") from None
        try:
            self.adapters.acquire(adapter)  # released when the request is done (`_done`)
        except AdapterProblem as err:
            raise BadRequest(str(err), "lora_path") from None
        self.queue.put(req)
        return req

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], rids: list[str],
                 images: list[RequestImages | None] | None = None,
                 routed_experts: bool = False, adapters: list[str | None] | None = None) -> list[Completion]:
        """Queue one request per prompt and wait for them all (they batch with others).
        `images`: each prompt's `prepare_images` (None: a text prompt). `routed_experts`:
        for every prompt, as SGLang's one `return_routed_experts` per call. `adapters`: each
        prompt's LoRA adapter (None: the base model)."""
        images = images if images is not None else [None] * len(prompts)
        adapters = adapters if adapters is not None else [None] * len(prompts)
        if not (len(params) == len(rids) == len(prompts) == len(images) == len(adapters)):
            raise BadRequest("input_ids, sampling_params, rid, image_data and lora_path differ in length")
        reqs = [self.submit(p, sp, rid, im, routed_experts, adapter)
                for p, sp, rid, im, adapter in zip(prompts, params, rids, images, adapters)]
        for req in reqs:
            req.done.wait()
            if req.error is not None:
                raise GenerationFailed(req.error)
        return [req.result for req in reqs]

    def health_generate(self) -> None:
        """Generate one greedy token (a check that the worker runs)."""
        self.submit([self.pad_id], SamplingParams(temperature=0.0, max_new_tokens=1), "health").done.wait()

    def _serve(self) -> None:
        while True:
            batch = [self.queue.get()]
            while len(batch) < self.max_batch_size:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self.batch_running = True
                self.batch_epoch = self.abort_epoch
                for adapter in dict.fromkeys(r.adapter for r in batch):  # one adapter merged per batch
                    self._run_isolated([r for r in batch if r.adapter == adapter])
            finally:
                self.batch_running = False

    def _run_isolated(self, batch: list[Request]) -> None:
        """Run a batch; when it fails, run each of its unfinished requests alone: a request
        that fails alone fails (`Request.error`), the others get their results."""
        try:
            self._run_batch(batch)
            return
        except Exception as err:
            log.error("a batch of %d request(s) failed (%s):\n%s", len(batch),
                      ", ".join(r.rid for r in batch[:8]), traceback.format_exc())
            why = type(err).__name__
        for req in [r for r in batch if not r.done.is_set()]:
            if len(batch) > 1:
                self._run_isolated([req])
            else:
                req.error = (f"request {req.rid} failed inside the engine ({why}); the engine's log has the "
                             "traceback")
                self._done(req)

    def _wait_unpaused(self, epoch: int) -> bool:
        """Block while paused; True when the batch (started at `epoch`) is to be aborted."""
        with self.pause_cv:
            while self.paused and self.abort_epoch == epoch:
                self.pause_cv.wait()
            return self.abort_epoch != epoch

    def _make_row(self, req: Request) -> _Row:
        p = req.params
        seed = p.sampling_seed % 2**64 if p.sampling_seed is not None else int(torch.randint(0, 2**62, (1,)))
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= self.eos_ids
        return _Row(req, p.temperature, p.top_p, p.top_k, p.max_new_tokens, list(p.stop), stop_ids, seed)

    def _check_finish(self, row: _Row, tok: int) -> None:
        if tok in row.stop_ids:
            row.finish = {"type": "stop", "matched": tok}
        elif row.stop:
            tail = self.tokenizer.decode(row.out_ids[-16:], skip_special_tokens=False)
            for s in row.stop:
                if s and s in tail:
                    row.finish = {"type": "stop", "matched": s}
                    return
        if row.finish is None and len(row.out_ids) >= row.max_new_tokens:
            row.finish = {"type": "length", "length": len(row.out_ids)}

    @torch.no_grad()
    def _run_batch(self, batch: list[Request]) -> None:
        from transformers import DynamicCache

        epoch = self.batch_epoch  # a re-run after a failed batch is aborted with it
        if self._wait_unpaused(epoch):
            for req in batch:
                self._finish(_make_aborted(req), req)
            return
        rows = [self._make_row(r) for r in batch]
        width = max(len(r.input_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[i, width - len(r.input_ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        extra = {}
        if self.vision:
            positions, extra = self._vision_inputs(batch, width)
        device = self.device
        ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
        extra = {k: v.to(device) for k, v in extra.items()}
        cache = DynamicCache()
        active = list(range(len(rows)))  # rows still decoding, in cache order
        for row in rows:
            if row.max_new_tokens <= 0:
                row.finish = {"type": "length", "length": 0}
        adapter = batch[0].adapter
        with self.model_lock:
            self.adapters.serve(adapter)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                logits_to_keep=1, **extra, **{self.cache_kw: cache}).logits[:, -1, :].float()
            version = self.weight_version
        record = self.routes is not None and any(r.routed_experts for r in batch)
        if record:  # each asking row's own (left-padded) prompt columns
            prefill = self.routes.take(len(batch), width)
            for i, row in enumerate(rows):
                row.routes = [prefill[i, width - len(row.req.input_ids):]] if row.req.routed_experts else None
        # the next token's position: the row's largest so far + 1 (after an image, more than its length)
        next_pos = (positions.amax(dim=(0, 2)) if self.vision else positions[:, -1]) + 1
        temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device)
        top_k = torch.tensor([r.top_k for r in rows], dtype=torch.long, device=device)
        top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)
        while True:  # the sampling settings are cut with the rows below, as the cache is
            picked, logprobs = sample_tokens(logits, temperature, top_k, top_p, token_uniforms(
                [rows[i].seed for i in active], [len(rows[i].out_ids) for i in active]).to(device))
            picked, logprobs = picked.tolist(), logprobs.tolist()
            tokens = []
            for j, i in enumerate(active):
                row = rows[i]
                if row.finish is None:
                    row.out_ids.append(picked[j])
                    row.logprobs.append(logprobs[j])
                    row.versions.append(version)
                    self._check_finish(row, picked[j])
                tokens.append(row.out_ids[-1] if row.out_ids else self.pad_id)
            keep = [j for j, i in enumerate(active) if rows[i].finish is None]
            for i in active:
                if rows[i].finish is not None and not rows[i].req.done.is_set():
                    self._finish(rows[i], rows[i].req)
            if not keep:
                return
            if self._wait_unpaused(epoch):
                for j in keep:
                    rows[active[j]].finish = {"type": "abort", "message": _ABORT_MESSAGE}
                    self._finish(rows[active[j]], rows[active[j]].req)
                return
            if len(keep) < len(active):
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                mask, next_pos = mask[index], next_pos[index]
                temperature, top_k, top_p = temperature[index], top_k[index], top_p[index]
                tokens = [tokens[j] for j in keep]
                active = [active[j] for j in keep]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=torch.long, device=device)], dim=1)
            step_positions = next_pos.unsqueeze(1)
            if self.vision:  # the three mrope axes alike, as for any text token
                step_positions = step_positions.unsqueeze(0).expand(3, -1, -1)
            with self.model_lock:
                self.adapters.serve(adapter)  # again after a weight update, which puts the base back
                logits = self.model(input_ids=torch.tensor(tokens, device=device).unsqueeze(1),
                                    attention_mask=mask, position_ids=step_positions, use_cache=True,
                                    **{self.cache_kw: cache}).logits[:, -1, :].float()
                version = self.weight_version
            if record:  # one fed token per active row (a row's last sampled token is never fed)
                step = self.routes.take(len(active), 1)
                for j, i in enumerate(active):
                    if rows[i].routes is not None:
                        rows[i].routes.append(step[j])
            next_pos = next_pos + 1

    def _vision_inputs(self, batch: list[Request], width: int) -> tuple[torch.Tensor, dict]:
        """A vision-language batch's left-padded mrope positions [3, rows, width] (padding
        at 0, masked out) and its images, rows in order."""
        positions = torch.zeros((3, len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            positions[:, i, width - len(r.input_ids):] = r.positions
        with_images = [r.images for r in batch if r.images is not None]
        if not with_images:
            return positions, {}
        return positions, {"pixel_values": torch.cat([im.pixel_values for im in with_images]),
                           "image_grid_thw": torch.cat([im.image_grid_thw for im in with_images])}

    def _finish(self, row: _Row, req: Request) -> None:
        req.result = Completion(
            rid=req.rid,
            text=self.tokenizer.decode(row.out_ids, skip_special_tokens=req.params.skip_special_tokens),
            output_ids=row.out_ids, logprobs=row.logprobs, finish_reason=row.finish,
            prompt_tokens=len(req.input_ids), weight_version=self.weight_version,
            routed_experts=np.concatenate(row.routes) if row.routes else None,
            token_versions=list(row.versions) if len(set(row.versions)) > 1 else None,
        )
        self._done(req)

    def _done(self, req: Request) -> None:
        if not req.done.is_set():
            self.adapters.release(req.adapter)
            req.done.set()

    # -- control -----------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"mode={mode!r}; use abort, in_place or retract")
        with self.pause_cv:
            self.paused = True
            if mode == "abort":  # the running batch and queued requests end now; new ones wait
                self.abort_epoch += 1
                while True:
                    try:
                        req = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    self._finish(_make_aborted(req), req)
            self.pause_cv.notify_all()

    def resume(self) -> None:
        with self.pause_cv:
            self.paused = False
            self.pause_cv.notify_all()

    # -- memory (colocated runs: engine_memory.py) ----------------------------------------
    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the memory of `tags` (None: all); only while idle, as SGLang."""
        tags = self._memory_tags(tags)
        with self.model_lock:
            if self.batch_running or not self.queue.empty():
                raise BadRequest("release_memory_occupation needs an idle engine (pause or finish generation first)")
            if "weights" in tags and "weights" not in self.released:
                self.adapters.restore_base()
                self.freed = free_parameters(self.model)
            self.released |= set(tags)
            if self.device.type == "cuda":  # back to the driver, for the colocated trainer
                torch.cuda.empty_cache()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Allocate the memory of `tags` again (None: all); resumed weights are zeros
        until the next weight update."""
        tags = self._memory_tags(tags)
        with self.model_lock:
            if "weights" in tags and "weights" in self.released:
                reallocate_parameters(self.freed)
                self.freed = []
            self.released -= set(tags)

    @staticmethod
    def _memory_tags(tags) -> list[str]:
        try:
            return memory_tags(tags)
        except ValueError as err:
            raise BadRequest(str(err)) from None

    # -- weights -----------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        self.in_update = True
        self.update_state = None
        self.fp8.clear()  # halves left by an update that never ended

    def end_weight_update(self) -> None:
        self.in_update = False
        self.update_state = None
        unpaired = self.fp8.unpaired()
        self.fp8.clear()
        if unpaired:
            raise BadRequest(f"the update ended with FP8 weights or scales missing their other half: {unpaired[:5]} "
                             "(each <name>.weight in float8_e4m3fn needs its <name>.weight_scale_inv)")

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def init_group(self, master_address: str, master_port: int, world_size: int, *, rank_offset: int = 1,
                   group_name: str = DEFAULT_GROUP, backend: str = "nccl", timeout_s: float = 300.0) -> None:
        """Join the trainer's weight-update group as ranks rank_offset... (rank 0 sends)."""
        if group_name in self.groups:
            raise BadRequest(f"group {group_name!r} exists; destroy it first")
        self.groups[group_name] = init_weight_update_group(master_address, master_port, rank_offset, world_size,
                                                           group_name, backend, timeout_s)

    def destroy_group(self, group_name: str = DEFAULT_GROUP) -> None:
        pg = self.groups.pop(group_name, None)
        if pg is None:
            raise BadRequest(f"no weight update group {group_name!r}")
        destroy_weight_update_group(pg)

    def update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                group_name: str = DEFAULT_GROUP, load_format: str | None = None,
                                weight_version: str | None = None) -> None:
        """Receive one announced bucket by broadcast from rank 0 (one uint8 tensor for
        load_format "flattened_bucket", else one broadcast per tensor) and load it."""
        if not self.in_update:
            raise BadRequest("update_weights_from_distributed outside begin_weight_update/end_weight_update")
        pg = self.groups.get(group_name)
        if pg is None:
            raise BadRequest(f"no weight update group {group_name!r}")
        try:
            torch_dtypes = [dtype_from_name(d) for d in dtypes]
        except ValueError as err:
            raise BadRequest(str(err), "dtypes") from None
        if not (len(names) == len(shapes) == len(torch_dtypes)):
            raise BadRequest("names, dtypes and shapes differ in length")
        if load_format not in (None, "direct", "flattened_bucket"):
            raise BadRequest(f"load_format={load_format!r}; use null or 'flattened_bucket'")
        flattened = load_format == "flattened_bucket"
        with self.model_lock, torch.no_grad():
            self.adapters.restore_base()
            views = self._weight_views(names, keep_vars=True)
            problem = self._load_problem(names, views, shapes)
            if problem:
                announced = sum(tensor_nbytes(s, d) for s, d in zip(shapes, torch_dtypes))
                if announced <= self.weight_bytes:  # so the sender never hangs; a larger one is no bucket of ours
                    receive_tensors(pg, torch_dtypes, shapes, flattened=flattened)
                raise BadRequest(problem)
            if self.fp8.carries_fp8(names, torch_dtypes):  # dequantized on the way in
                self._copy_in(list(zip(names, receive_tensors(pg, torch_dtypes, shapes, flattened=flattened))),
                              views)
            elif flattened:
                self.receive_scratch = receive_flat_bucket(pg, [views[n] for n in names], torch_dtypes, shapes,
                                                           self.receive_scratch)
            else:
                receive_per_tensor(pg, [views[n] for n in names], torch_dtypes, shapes)
        if weight_version is not None:
            self.weight_version = weight_version

    def update_from_tensor(self, serialized_named_tensors: list[str], *, load_format: str | None = None,
                           weight_version: str | None = None) -> None:
        """Load the tensors whose handles the trainer sent (weight_tensors.py), entry 0
        (this engine's only rank; `RankedEngine` gives each rank its own)."""
        if not self.in_update:
            raise BadRequest("update_weights_from_tensor outside begin_weight_update/end_weight_update")
        self.load_weights(_own_entry(serialized_named_tensors, load_format))  # copies out of the sender's memory
        if weight_version is not None:
            self.weight_version = weight_version

    def update_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        if not self.in_update:
            raise BadRequest("update_weights_from_disk outside begin_weight_update/end_weight_update")
        try:
            config = json.loads((Path(model_path) / "config.json").read_text())
        except (OSError, ValueError, RecursionError) as err:  # none, unreadable, not JSON, nested too deep
            raise BadRequest(f"model_path {model_path} has no readable config.json ({type(err).__name__}: "
                             f"{_clip(err)})", "model_path") from None
        if not isinstance(config, dict):
            raise BadRequest(f"model_path {model_path}: config.json is not a JSON object", "model_path")
        try:
            if fp8_block_size(config.get("quantization_config")) or self.vision:  # a VLM's names: vision_weight_view
                named = checkpoint_tensors(model_path)
            else:
                named = list(self._model_class().from_pretrained(model_path, dtype=self.dtype).state_dict().items())
        except Exception as err:  # the directory's content is the request's
            raise BadRequest(f"the weights in {model_path} could not be loaded: {type(err).__name__}: {_clip(err)}",
                             "model_path") from None
        self.load_weights(named)
        self.model_path = model_path
        if weight_version is not None:
            self.weight_version = weight_version

    # -- LoRA adapters (rollout/engine_lora.py) ------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> None:
        """A PEFT adapter directory, as adapter `name`."""
        try:
            self._load_adapter(name, *read_peft_dir(path))
        except AdapterProblem as err:
            raise BadRequest(str(err), "lora_path") from None

    def load_lora_adapter_from_tensors(self, name: str, config: dict, serialized_named_tensors: list[str],
                                       load_format: str | None = None) -> None:
        """An adapter whose tensors' handles the trainer sent (entry 0: this engine's rank)."""
        self._load_adapter(name, config, dict(_own_entry(serialized_named_tensors, load_format)))  # copied

    def _load_adapter(self, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        with self.model_lock:
            try:
                self.adapters.load(name, config, tensors)
            except AdapterProblem as err:
                raise BadRequest(str(err)) from None

    def unload_lora_adapter(self, name: str) -> None:
        try:
            self.adapters.unload(name, self.model_lock)
        except AdapterProblem as err:
            raise BadRequest(str(err), "lora_name") from None

    def weight_view(self, name: str) -> torch.Tensor | None:
        """The model tensor a checkpoint-format HF name refers to (None if none does)."""
        return self._view_of(self.model.state_dict(), name)

    def _view_of(self, state: dict, name: str) -> torch.Tensor | None:
        return vision_weight_view(state, name) if self.vision else weight_view(state, name)

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self.released:
            raise BadRequest("the weights' memory is released: POST /resume_memory_occupation "
                             "{\"tags\": [\"weights\"]} before loading weights")
        views = self._weight_views([n for n, _ in named])
        problem = self._load_problem([n for n, _ in named], views, [t.shape for _, t in named])
        if problem:
            raise BadRequest(problem)
        with self.model_lock:
            self.adapters.restore_base()
            self._copy_in(named, views)

    @torch.no_grad()
    def _copy_in(self, named: list[tuple[str, torch.Tensor]], views: dict | None = None) -> set[int]:
        """Copy tensors into the model (FP8 weights dequantized once their scale is in too);
        the storages written to."""
        pairs = self.fp8.take(named)
        views = dict(views or {})
        earlier = [n for n, _ in pairs if n not in views]  # an FP8 weight whose other half came before
        if earlier:
            views.update(self._weight_views(earlier))
        for n, t in pairs:
            views[n].copy_(t)
        return {views[n].untyped_storage().data_ptr() for n, _ in pairs}

    def _weight_views(self, names: list[str], keep_vars: bool = False) -> dict[str, torch.Tensor | None]:
        """Each name's model tensor (a scale's: the weight it scales)."""
        if keep_vars and self.in_update:  # the parameters themselves
            if self.update_state is None:
                self.update_state = self.model.state_dict(keep_vars=True)
            state = self.update_state
        else:
            state = self.model.state_dict(keep_vars=keep_vars)
        return {n: self._view_of(state, weight_name_of(n) or n) for n in names}

    def _load_problem(self, names: list[str], views: dict[str, torch.Tensor | None], shapes: list) -> str | None:
        """Why these tensors cannot be loaded (None: they can)."""
        if "weights" in self.released:
            return ("the weights' memory is released: POST /resume_memory_occupation "
                    "{\"tags\": [\"weights\"]} before loading weights")
        unknown = [n for n in names if views[n] is None]
        if unknown:
            return f"unknown parameter names: {unknown[:5]}"
        for n, shape in zip(names, shapes):
            want = tuple(views[n].shape)
            if weight_name_of(n):
                want = scale_shape(want, self.fp8.block)
            if tuple(shape) != want:
                return f"{n}: shape {tuple(shape)}, the model {'needs' if weight_name_of(n) else 'has'} {want}"
        return None

    def weight_checksums(self, names: list[str]) -> dict[str, float]:
        """`weight_group.weight_checksum` of each named tensor (the weight-sync check)."""
        views = {n: self.weight_view(n) for n in names}
        missing = [n for n, v in views.items() if v is None]
        if missing:
            raise BadRequest(f"unknown weight names {missing[:5]}")
        return {n: weight_checksum(v) for n, v in views.items()}

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "is_generation": True, "weight_version": self.weight_version,
                "engine": "megatron-agent-embedded", "memory_released": sorted(self.released),
                "lora_adapters": sorted(self.adapters.loaded)}


def _own_entry(serialized_named_tensors: list[str], load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """Entry 0 of `serialized_named_tensors` (this engine's only rank; `RankedEngine` gives
    each rank its own): (name, tensor) pairs, views of the sender's memory."""
    if not serialized_named_tensors:
        raise BadRequest("serialized_named_tensors is empty (one entry per engine rank)")
    try:
        return _named_tensors(deserialize_named_tensors(serialized_named_tensors[0], load_format))
    except Exception as err:  # what the entry holds is the request's: no failure of it is the engine's
        raise BadRequest(f"serialized_named_tensors: {type(err).__name__}: {_clip(err)}",
                         "serialized_named_tensors") from None


def _named_tensors(named) -> list[tuple[str, torch.Tensor]]:
    """What an update's entry unpickled to, checked: (name, real-valued tensor) pairs."""
    named = list(named)
    for i, (name, tensor) in enumerate(named):
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor) or tensor.is_complex():
            raise TypeError(f"entry {i} is not a (name, real tensor) pair")
    return named


def _clip(err: BaseException, limit: int = 300) -> str:
    text = str(err)
    return text if len(text) <= limit else text[:limit] + "..."


def _make_aborted(req: Request) -> _Row:
    return _Row(req, 0.0, 1.0, -1, 0, [], set(), None, finish={"type": "abort", "message": _ABORT_MESSAGE})
