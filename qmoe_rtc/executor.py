"""The GPU executor: a QMoE layer on CuPy arrays or torch CUDA tensors.

``QMoE(...)`` first validates everything that metadata tells (attributes, every tensor's dtype, shape
and contiguity, the limits of this build; content when asked) without touching CUDA, so a bad layer
is refused the same way on a machine without a GPU; then it checks the driver and GPU
(:func:`qmoe_rtc.jit.driver.probe`: ``DeviceError`` saying what is missing) and uploads the tensors
once (zero copy for CuPy / torch). A call has two steps:

- **plan** (first call at a given shape/dtypes, never inside graph capture): pick the path
  (decode / prefill) and the fastest pipeline that runs the layer (``qmoe_rtc.kernels.pipelines``),
  compile or load its modules, size a scratch pool; all of it cached;
- **run**: writes the call's addresses into pre-packed launches and launches them on the caller's
  current stream (torch's for torch tensors, CuPy's otherwise): no allocation other than the output
  (none with ``out=``), no host synchronisation. It is what a CUDA graph records, whether
  :meth:`QMoE.capture` makes it or the caller's own capture (``torch.cuda.graph``, CuPy stream capture).

Scratch: one pool per stream, so forwards of one layer on two streams never share buffers. Inside a
capture on a stream that has no pool, the layer records on the first pool already sized for that
shape (run one eager call at the shape, or :meth:`QMoE.reserve`, first); graphs of one layer
captured that way share that pool, so replay them in order (as a serving loop does).
"""

from __future__ import annotations

import logging
import threading

from ._arrays import device_of, dtype_name, is_c_contiguous, shape_str
from .contract.checks import INPUT_NAMES, LAYER_INPUTS, CallSpec, QMoEAttributes, check_call
from .contract.extensions import EXT_INPUTS, check_ext_call
from .errors import CaptureError, DeviceError, QMoEInputError, QMoEUnsupportedError
from .jit.driver import max_smem_optin, probe, sm_count, stream_is_capturing
from .kernels import Problem, choose, decode_limit, get_family
from .runtime.check import check_layer
from .runtime.eager_graph import GraphedLaunches
from .runtime.expert_counts import ExpertCounts
from .runtime.graph import QMoEGraph, capture_launches
from .runtime.interop import (
    allocate_like,
    cupy,
    cupy_stream,
    current_stream,
    data_ptr,
    is_host_array,
    is_host_signature,
    parse_device,
    signature,
    to_cupy,
)
from .runtime.layer import describe_gpu_layer, layer_config, upload_layer
from .runtime.plan import Plan, launched, load_launched
from .runtime.scratch import ScratchPool
from .settings import knobs
from .specialize import ModelConfig

__all__ = ["QMoE", "QMoEGraph", "layer_config"]

log = logging.getLogger("qmoe_rtc")
_said: set = set()  # slower-engine reasons already logged in this process
_said_lock = threading.Lock()


def _resolve_device(want: int | None) -> int:
    """The device a layer goes to (``want``, else the current one), after :func:`driver.probe` has
    checked that the driver and that GPU can run layers."""
    probe()
    if want is None:
        try:
            want = int(cupy().cuda.runtime.getDevice())
        except Exception as exc:  # CuPy's runtime disagreeing with the driver probe: still a device problem
            raise DeviceError(f"no current CUDA device ({type(exc).__name__}: {exc})") from exc
    probe(want)
    return want


class _Call:
    """What a call signature resolved to: its validated sizes, plan and stream getter, and the launches
    it last ran (kept while the stream and that pool's buffers stay the same)."""

    __slots__ = ("bound", "bound_stream", "plan", "spec", "stream")

    def __init__(self, spec: CallSpec, plan: Plan | None, stream):
        self.spec, self.plan, self.stream = spec, plan, stream
        self.bound, self.bound_stream = None, None


class QMoE(ExpertCounts):
    """One quantized MoE layer on the GPU, with ONNX Runtime's QMoE inputs and attributes.

    Expert tensors (inputs 2–13) are keyword arguments with ONNX Runtime's names; attributes too
    (``k``, ``activation_type``, ``expert_weight_bits``, ``block_size``, ``swiglu_fusion`` ...).
    Arrays may be CuPy, torch CUDA tensors (zero copy) or NumPy (uploaded once). [ext] Shared experts
    (``shared_fc1_experts_weights`` ..., optional ``shared_gate_weight``) run as more routes per token
    in the routed launches, so they need the routed layout; with ``router_weight`` (and maybe
    ``router_bias``) the layer computes its logits and a call passes ``router_probs=None``
    (docs/contract.md). Expert slices [ext]: ``expert_range=(e0, e1)`` with ``num_experts=E`` (or an
    ``expert_map`` [E] of local indices / -1): the weights hold only those experts, routing runs over
    all E logits and a call returns this slice's partial output in T (:mod:`qmoe_rtc.contract.slices`,
    :mod:`qmoe_rtc.distributed`).

    ``decode_max_routes``: rows·k up to which the decode path runs (default: the crossover measured
    for this shape on this device, :func:`qmoe_rtc.kernels.decode_limit`). ``prepack``: 'auto' (default: the
    ``QMOE_RTC_PREPACK`` knob), 'on' / True or 'off' / False: whether the codes are converted once, on
    the GPU, into the tiled layout the tensor-core engines read (:mod:`qmoe_rtc.tiled.transform`); 'auto' does
    when the scales or biases fix the activations to float16/bfloat16. A layer that tiles keeps no
    reference to the given ``*_experts_weights`` arrays. ``prepack='given'``: every ``*_experts_weights``
    is tiled already, [E, N/8, ceil(K/128), 8, 4, 4·b] u8 (:func:`qmoe_rtc.tiled.given.tiled_weights`,
    :meth:`tiled_weights`), and is used as it is (zero copy for device arrays). ``expert_counts``: expert
    statistics [ext], the routes each expert gets counted inside the routing kernel (:attr:`expert_counts`).
    ``validate_content``: also check scales,
    biases and zero-point padding once (reads the tensors back to the host). ``device``: an index,
    ``'cuda:N'`` or ``'cuda'`` (default: where the weights are, else the current device).

    Raises ``QMoEInputError`` / ``QMoEAttributeError`` (bad input), ``QMoEUnsupportedError`` (a limit
    of this build) before anything touches the GPU, then ``DeviceError`` (no driver, driver too old,
    no GPU, out of device memory).
    """

    def __init__(self, *, decode_max_routes: int | None = None, validate_content: bool = False,
                 device: int | str | None = None, expert_range=None, expert_map=None, num_experts=None,
                 prepack: bool | str | None = None, expert_counts: bool = False, **kwargs):
        slice_args = dict(expert_range=expert_range, expert_map=expert_map, num_experts=num_experts)
        weights = {n: kwargs.pop(n) for n in list(kwargs) if n in LAYER_INPUTS + EXT_INPUTS}
        for n in list(kwargs):
            if n in INPUT_NAMES:
                raise QMoEInputError(n, "a per-call input: pass it to the layer call, not to QMoE()", "a constructor argument")
        self.attrs = QMoEAttributes.from_kwargs(**kwargs)
        if type(expert_counts) is not bool:
            raise QMoEInputError("expert_counts", "True or False", repr(expert_counts))
        if decode_max_routes is not None and (type(decode_max_routes) is not int or decode_max_routes < 0):
            raise QMoEInputError("decode_max_routes", "None or a non-negative integer", repr(decode_max_routes))
        want = parse_device(device)
        # 1. everything that metadata can tell, before CUDA is touched: the same refusals with or without a GPU
        given = prepack == "given"  # codes passed tiled: checked as their contract shapes, uploaded as they are
        checked = check_layer(weights, self.attrs, slice_args, prepack, validate_content, want, device)
        layer, self._tiled = checked.gpu.layer, checked.tiled
        # 2. the GPU: a DeviceError saying what is missing (no driver, driver too old, no GPU)
        self.device_id = _resolve_device(want if want is not None else layer.device_id)
        cp = cupy()
        try:
            w = {n: to_cupy(n, a, self.device_id) for n, a in weights.items()}
            g = describe_gpu_layer(w, self.attrs, slice_args, given)  # the device arrays themselves, as every call sees them
            self.layer, self.ext, self.slice, self._routing = g.layer, g.ext, g.slice, g.routing
            # keep the caller's arrays alive (not the codes once tiled: the caller may free them)
            self._weights = {n: a for n, a in w.items() if not (self._tiled and n.endswith("_experts_weights"))}
            self.scale_dtype, self._proj, self._table = upload_layer(cp, w, self.layer, self.ext, self.device_id,
                                                                     self.slice, tiled=self._tiled, given=given)
            del w
            if expert_counts:  # [E] i64 over the whole layer's experts (a slice counts all of them)
                self._table["expert_counts"] = cp.zeros(self._routing.E, dtype=cp.int64)
        except (cp.cuda.memory.OutOfMemoryError, cp.cuda.runtime.CUDARuntimeError) as exc:
            raise DeviceError(f"uploading the layer to cuda:{self.device_id} failed: {type(exc).__name__}: {exc}") from exc
        self._decode_max_routes = decode_max_routes
        self._eager_graphs = bool(knobs.get("eager_graphs"))
        self._plans: dict = {}  # (rows, dtype, router dtype, router_weights dtype) -> Plan
        self._calls: dict = {}  # call signature -> _Call
        self._pools: dict = {}  # stream handle -> ScratchPool
        self._arch_cache: str | None = None  # the device's compile target, read on first plan
        self._stream_of = None  # the last call's stream getter (torch's or CuPy's current stream)

    # -- layout and choice -----------------------------------------------------------------------
    @property
    def tiled(self) -> bool:
        """Whether the layer holds its codes in the tiled layout of the tensor-core engines (``prepack``)."""
        return self._tiled

    def tiled_weights(self) -> dict:
        """The codes of a tiled layer by input name (``fc1_experts_weights`` ..., ``shared_fc*_experts_weights``):
        the layer's own CuPy buffers [E, N/8, ceil(K/128), 8, 4, 4·b] u8 (read only), what ``prepack='given'``
        takes (:mod:`qmoe_rtc.tiled.given`; layout :data:`qmoe_rtc.tiled.transform.LAYOUT_VERSION`)."""
        if not self._tiled:
            raise QMoEUnsupportedError("this layer holds its codes in the contract layout (prepack='off', or 'auto' "
                                       "with float32 scales): build it with prepack='on' to get tiled codes")
        shared = {f"shared_{p}_experts_weights": self._table[f"shared_{p}_w"] for p in ("fc1", "fc2")}
        return {**{f"{p}_experts_weights": w for p, (w, *_) in self._proj.items()},
                **{n: w for n, w in shared.items() if w is not None}}

    def model_config(self, dtype: str) -> ModelConfig:
        """The :class:`~qmoe_rtc.specialize.ModelConfig` of this layer for activation dtype ``dtype``."""
        return layer_config(self.layer, dtype, self.scale_dtype, self.ext, self._all_experts, tiled=self._tiled,
                            expert_counts=self._table.get("expert_counts") is not None)

    @property
    def decode_max_routes(self) -> int:
        """Routes (rows·k) up to which the decode path runs."""
        if self._decode_max_routes is not None:
            return self._decode_max_routes
        return decode_limit(self.model_config(self.layer.dtype or "float16"), self._arch())

    def path_for(self, rows: int) -> str:
        """``"decode"`` or ``"prefill"`` for ``rows`` tokens."""
        return "decode" if int(rows) * self.attrs.k <= self.decode_max_routes else "prefill"

    def problem(self, rows: int, dtype: str, router_dtype: str = "float32", router_weights_dtype: str | None = None,
                config: ModelConfig | None = None):
        """The :class:`~qmoe_rtc.kernels.base.Problem` of a call of ``rows`` tokens: the layer's part read from
        :meth:`model_config` (one place: the plan's choices and the launches see the same layer; ``config``: that
        config, already built by the caller), the call's and the device's from the arguments."""
        return Problem.for_config(config or self.model_config(dtype), int(rows), router_dtype=router_dtype,
                                  router_weights_dtype=router_weights_dtype, arch=self._arch(),
                                  sms=sm_count(self.device_id), smem=max_smem_optin(self.device_id))

    @property
    def _all_experts(self) -> int:
        """The whole layer's E for an expert slice [ext] (0 otherwise)."""
        return self.slice.num_experts if self.slice is not None else 0

    def _arch(self) -> str:
        if self._arch_cache is None:
            from .jit.compiler import default_arch

            self._arch_cache = default_arch(self.device_id)
        return self._arch_cache

    def engine_for(self, rows: int, dtype: str, router_dtype: str = "float32", router_weights_dtype=None):
        """The pipeline a call at ``rows`` would run, and why faster ones cannot (compiles nothing)."""
        config = self.model_config(dtype)
        return choose(config, self.problem(rows, dtype, router_dtype, router_weights_dtype, config), self.path_for(rows))

    # -- plan ------------------------------------------------------------------------------------
    def plan(self, rows: int, dtype: str, router_dtype: str = "float32", router_weights_dtype: str | None = None,
             stream: int | None = None) -> Plan:
        """The plan of a call (compiles or loads its kernels on first use; never inside capture)."""
        return self._plan_sizes((int(rows),), dtype, router_dtype, router_weights_dtype, stream)[0]

    def _plan_sizes(self, sizes, dtype: str, router_dtype: str, router_weights_dtype: str | None,
                    stream: int | None = None) -> list[Plan]:
        """The plans of calls at each of ``sizes`` rows; the kernels of those not planned yet are loaded in one
        batch (their pieces compiled side by side: QMoE.reserve plans every size at once)."""
        keys = [(r, dtype, router_dtype, router_weights_dtype) for r in sizes]
        todo = [k for k in keys if k not in self._plans]
        if todo and stream is not None and stream_is_capturing(stream):
            raise CaptureError(f"no plan for rows={todo[0][0]}, dtype={dtype} inside graph capture: run one eager call "
                               "at this shape (or QMoE.reserve(max_rows)) before capturing")
        choices = {k: self._choice(k[0], dtype, router_dtype, router_weights_dtype) for k in todo}
        modules = load_launched([launched(c.pipeline, specs, cfg, p) for cfg, p, c, specs in choices.values()],
                                self.device_id) if todo else {}
        for k, (config, problem, choice, specs) in choices.items():
            for name, why in choice.skipped:
                self._say(f"qmoe_rtc: {choice.pipeline.path} path runs {choice.pipeline.name} instead of the faster "
                          f"{name}: {why}")
            plan = self._plans[k] = Plan.build(config, problem, choice.pipeline, specs, modules)
            log.info("qmoe_rtc: planned rows=%d dtype=%s: %s (%s)", k[0], dtype, plan.engine,
                     ", ".join(s.name for s in specs.values()))
        return [self._plans[k] for k in keys]

    def _choice(self, rows: int, dtype: str, router_dtype: str, router_weights_dtype: str | None):
        """(config, problem, choice, each family's spec) of a call at ``rows`` (compiles nothing)."""
        if self.scale_dtype not in ("float32", dtype):
            raise QMoEInputError("input", f"dtype {self.scale_dtype} (the layer's scales)", f"dtype {dtype}")
        config = self.model_config(dtype)
        problem = self.problem(rows, dtype, router_dtype, router_weights_dtype, config)
        choice = choose(config, problem, self.path_for(rows))
        return config, problem, choice, {f: get_family(f).spec(config) for f in choice.pipeline.families}

    @staticmethod
    def _say(msg: str) -> None:
        with _said_lock:
            if msg in _said:
                return
            _said.add(msg)
        log.warning(msg)

    def _pool(self, stream: int, plan: Plan) -> ScratchPool:
        pool = self._pools.get(stream)
        if pool is not None:
            return pool
        if stream_is_capturing(stream):  # an external capture: record on a pool already sized for this plan
            for p in self._pools.values():
                if not p.missing(plan.needs):
                    return p
            raise CaptureError(f"no scratch pool is sized for rows={plan.problem.rows} inside graph capture: run one "
                               "eager call at this shape, or QMoE.reserve(max_rows), before capturing")
        pool = self._pools[stream] = ScratchPool(self.device_id, f"stream {stream:#x}")
        return pool

    def reserve(self, max_rows: int, dtype: str | None = None, router_dtype: str = "float32",
                router_weights_dtype: str | None = None, stream=None) -> None:
        """Plan every batch size 1..max_rows and size one scratch pool (the current CuPy stream's, or
        ``stream``'s: a raw handle or a stream object) for all of them, so graphs of all those sizes
        can then be captured on it with no allocation or compile inside the capture."""
        dtype = dtype or self.layer.dtype
        if dtype is None:
            raise QMoEInputError("dtype", "the activation dtype (the layer's scales are float32, so it is not implied)",
                                 "None")
        if type(max_rows) is not int or max_rows < 1:
            raise QMoEInputError("max_rows", "a positive integer", repr(max_rows))
        handle = cupy().cuda.get_current_stream(self.device_id).ptr if stream is None else \
            int(getattr(stream, "cuda_stream", getattr(stream, "ptr", stream)))
        plans = self._plan_sizes(range(1, max_rows + 1), dtype, router_dtype, router_weights_dtype, handle)
        pool = self._pool(handle, plans[-1])
        needs: dict = {}
        for p in plans:
            for n, s in p.needs.items():
                if n not in needs or needs[n].nbytes < s.nbytes:
                    needs[n] = s
        pool.ensure(needs, handle)
        for p in plans:
            p.bind(pool, self._table, handle)

    # -- run -------------------------------------------------------------------------------------
    def _resolve(self, key, input, router_probs, router_weights, out) -> _Call:
        """First call with this signature: validate everything, plan, cache."""
        call = (check_ext_call(self._routing, self.ext, input, router_probs, router_weights) if self.ext.used else
                check_call(self._routing, input, router_probs, router_weights))
        if out is not None:
            if tuple(out.shape) != call.input_shape or dtype_name(out) != call.dtype:
                raise QMoEInputError("out", f"{call.dtype} {shape_str(call.input_shape)} (the input's)",
                                     f"{dtype_name(out)} {shape_str(out.shape)}")
            if not is_c_contiguous(out):
                raise QMoEInputError("out", "a C-contiguous array", "a non-contiguous view")
            if device_of(out) != self.device_id:
                raise DeviceError(f"output 'out': expected cuda:{self.device_id} (where the weights are), got "
                                  f"{device_of(out)}")
        get_stream = current_stream(input, self.device_id)
        plan = None
        if call.rows:
            plan = self.plan(call.rows, call.dtype, call.router_dtype, call.router_weights_dtype,
                             get_stream(self.device_id))
        entry = self._calls[key] = _Call(call, plan, get_stream)
        self._stream_of = get_stream
        return entry

    def __call__(self, input, router_probs, router_weights=None, out=None):
        """Run the layer: ``input`` [rows, H] or [B, S, H], ``router_probs`` [rows, E] logits.

        Returns the output in the input's shape, dtype and array type (``out`` itself when given), on
        the current stream (torch's current stream for torch inputs).
        """
        key = (signature(input), signature(router_probs), signature(router_weights), signature(out))
        call = self._calls.get(key)
        if call is None:
            if any(is_host_signature(s) for s in key[:3]):  # NumPy inputs: uploaded (a copy and a sync per call)
                return self(*(to_cupy(n, a, self.device_id) if is_host_array(a) else a for n, a in
                              (("input", input), ("router_probs", router_probs), ("router_weights", router_weights))),
                            out=out)
            call = self._resolve(key, input, router_probs, router_weights, out)
        stream = call.stream(self.device_id)
        xp = data_ptr(input)
        if xp & 15:  # the kernels read activation rows with 16-byte loads
            input, xp = self._aligned_copy(input, stream)
        if out is None:
            if stream_is_capturing(stream):
                raise CaptureError("inside graph capture pass out= (an output cannot be allocated while capturing)")
            out = allocate_like(input, call.spec.input_shape, call.spec.dtype, self.device_id)
        if call.plan is not None:
            b = call.bound
            if b is None or call.bound_stream != stream or b.generation != b.pool.generation:
                b = call.plan.bind(self._pools.get(stream) or self._pool(stream, call.plan), self._table, stream)
                call.bound, call.bound_stream = b, stream
            ptrs = (xp, data_ptr(router_probs), data_ptr(router_weights), data_ptr(out))
            if len(b.items) > 1 and self._eager_graphs and not stream_is_capturing(stream):
                g = b.graphed or self._graphed(b)
                g.launch(stream, ptrs)  # one driver launch for the whole forward
            else:
                b.launch(stream, ptrs)  # inside a capture: the plain launches are recorded
        return out

    def _graphed(self, bound):
        bound.graphed = GraphedLaunches(bound, self.device_id)
        return bound.graphed

    def _aligned_copy(self, input, stream: int):
        if stream_is_capturing(stream):
            raise QMoEInputError("input", "a 16-byte aligned array inside graph capture (the kernels read it with "
                                 "16-byte loads; outside capture it is copied)",
                                 f"an address {data_ptr(input) % 16} bytes past a 16-byte boundary")
        if hasattr(input, "clone"):  # torch: copies on torch's current stream
            x = input.clone()
        else:
            with cupy_stream(stream, self.device_id):
                x = input.copy()
        return x, data_ptr(x)

    # -- graphs ----------------------------------------------------------------------------------
    def capture(self, input, router_probs, router_weights=None, out=None) -> QMoEGraph:
        """Record one forward into a CUDA graph on the caller's own arrays (no copies).

        Runs once eagerly first (plans, compiles, sizes the scratch of the current stream). Write new
        values into ``input`` / ``router_probs`` / ``router_weights`` (the arrays passed here), then
        ``graph.replay()``; the result is in ``graph.output`` (``out`` when given).
        """
        if stream_is_capturing(current_stream(input, self.device_id)(self.device_id)):
            raise CaptureError("QMoE.capture() inside another capture: call the layer itself (with out=) there")
        key = (signature(input), signature(router_probs), signature(router_weights), signature(out))
        out = self(input, router_probs, router_weights, out=out)
        call = self._calls[key]
        if data_ptr(input) & 15:
            raise QMoEInputError("input", "a 16-byte aligned array for capture() (the graph reads it in place)",
                                 f"an address {data_ptr(input) % 16} bytes past a 16-byte boundary")
        stream = call.stream(self.device_id)
        bound = None
        if call.plan is not None:
            bound = call.plan.bind(self._pools[stream], self._table, stream)
        ptrs = (data_ptr(input), data_ptr(router_probs), data_ptr(router_weights), data_ptr(out))
        graph = capture_launches(bound, stream, ptrs, self.device_id)
        keep = (bound.pool.snapshot(), self._proj) if bound is not None else (self._proj,)
        return QMoEGraph(graph, input, router_probs, router_weights, out, self.device_id, call.stream, keepalive=keep)
