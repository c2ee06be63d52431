"""The GPU executor: a QMoE layer on CuPy arrays (or torch tensors through DLPack).

``QMoE(...)`` validates and uploads the expert tensors once. A call goes through two steps:

- **plan** (first call at a given shape/dtype, never inside graph capture): pick the decode or the
  prefill path, compile or load the kernel modules, and grow the scratch pool;
- **run**: launches only, on the current stream, no host synchronisation and no allocation other
  than the output (none when ``out=`` is given). It is what a CUDA graph records.

Decode path (``rows·k <= decode_max_routes``), three launches: route → FC1 (activation fused) →
FC2 (weighted combine fused). float16/bfloat16 layouts with 1/2/4/8-bit weights use the tensor-core,
expert-grouped ``mma`` kernels (each expert read once); the others use the SIMT ``gemv`` kernels
(logged with the reason). Prefill path: route → group_by_expert → fc1_gemm → fc2_gemm → combine,
five launches.

Graphs: :meth:`QMoE.capture` records one forward on static buffers; write new inputs into
``graph.input`` / ``graph.router_probs`` (or call ``graph.update``) and ``graph.replay()``. Shapes
are fixed per graph: capture one graph per batch size.

One forward of a layer at a time: calls and graph replays of the same layer share its scratch pool
(routes, activations, the FC2 tile counters), so they must not overlap on different streams
(order them on one stream, or build one layer object per concurrent stream).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ._arrays import dtype_name, is_cupy, np_dtype, shape_str
from .contract import INPUT_NAMES, WEIGHT_INPUTS, LayerSpec, QMoEAttributes, check_call, check_content, describe_layer
from .errors import CaptureError, DeviceError, QMoEInputError

__all__ = ["QMoE", "QMoEGraph", "qmoe", "DEFAULT_DECODE_MAX_ROUTES"]

log = logging.getLogger("qmoe_rtc")

#: Routes (rows·k) up to which the decode path is used; above it, the grouped GEMM path. Measured on
#: the H200 (docs/performance.md): at 512 routes (qwen3-30b-a3b, 64 tokens) the tensor-core decode
#: kernels take 0.40 ms, the SIMT grouped GEMM 2.07 ms. 512 is also what one mma block scans
#: (kernels/mma.py MAX_ROUTES); a larger value sends the extra calls to the SIMT GEMV kernels.
DEFAULT_DECODE_MAX_ROUTES = 512


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - cupy is a dependency
        raise DeviceError(f"the GPU executor needs CuPy ({exc})") from exc
    return cupy


def _is_torch(a) -> bool:
    return type(a).__module__.split(".", 1)[0] == "torch"


def _to_cupy(name, a, device_id=None):
    """CuPy view of a CuPy array, a torch tensor / ``__dlpack__`` object (zero copy), or a NumPy copy."""
    if a is None:
        return None
    cp = _cupy()
    if is_cupy(a):
        return a
    if hasattr(a, "__dlpack__") and not type(a).__module__.startswith("numpy"):
        try:
            return cp.from_dlpack(a)
        except Exception as exc:
            raise QMoEInputError(name, "a CUDA array exportable through DLPack", f"{type(a).__name__} ({exc})") from None
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        with cp.cuda.Device(device_id if device_id is not None else cp.cuda.runtime.getDevice()):
            return cp.asarray(a)
    raise QMoEInputError(name, "a CuPy array, a torch CUDA tensor or a NumPy array", type(a).__name__)


def _word_readable(cp, a, name):
    """``a`` itself when it starts on a 16-byte boundary and its size is whole 4-byte words, else a
    padded aligned copy (made once). The tensor-core decode kernels copy scales and zero points as
    the aligned 4-byte words that hold them: those words must lie inside the array."""
    if a.data.ptr % 16 == 0 and a.nbytes % 4 == 0:
        return a
    log.info("qmoe_rtc: %s is not 16-byte aligned or not whole 4-byte words; copied once", name)
    buf = cp.zeros(((a.nbytes + 15) // 16) * 16, dtype=cp.uint8)
    buf[: a.nbytes] = cp.ascontiguousarray(a).view(cp.uint8).ravel()
    return buf[: a.nbytes].view(a.dtype).reshape(a.shape)


def _torch_stream(cp, ts, device_id):
    """A CuPy view of a torch CUDA stream."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(ts)
        except Exception:  # older torch without the CUDA stream protocol
            pass
    return cp.cuda.ExternalStream(ts.cuda_stream, device_id)


@dataclass
class _Plan:
    """What a call at one (rows, dtypes) needs: its path and loaded kernels."""

    path: str  # "decode" | "prefill"
    kernels: dict  # role -> jit.Kernel
    specs: dict  # family -> ModuleSpec
    engine: str = ""  # decode: "mma" (tensor cores, expert-grouped) or "gemv" (SIMT); prefill: "gemm"
    launches: dict = field(default_factory=dict)  # rows -> (scratch generation, packed launches)


class _Scratch:
    """Pooled scratch owned by a layer, grown outside capture only.

    Slots (R = rows·k routes):
      topk_ids [R] i32, topk_w [R] f32, act [R, I] f32 (decode: viewed as T) / act_sorted [R, I] f32
      (prefill), y [R, H] f32 (per-route FC2 output), counters [H/16 + 1] u32 (mma decode: blocks done
      per output tile, zero between calls; the kernel that counts resets them),
      offsets [E+1] i32, tile_offsets [E+1] i32, sorted [R] i32 (prefill only).
    """

    def __init__(self, E: int, H: int, I: int, device_id: int):
        self.E, self.H, self.I, self.device_id = E, H, I, device_id
        self.routes = 0
        self.prefill = False
        self.bufs: dict = {}
        self.generation = 0  # bumped on every regrowth: packed launches hold buffer pointers

    def ensure(self, routes: int, prefill: bool) -> None:
        if routes <= self.routes and (self.prefill or not prefill):
            return
        cp = _cupy()
        if cp.cuda.get_current_stream().is_capturing():
            raise CaptureError(
                f"the scratch pool holds {self.routes} routes{' (decode only)' if not self.prefill else ''}, this call "
                f"needs {routes}{' (prefill)' if prefill else ''}: run one eager call at this shape before capturing")
        R = max(routes, self.routes)
        prefill = prefill or self.prefill
        with cp.cuda.Device(self.device_id):
            b = {
                "topk_ids": cp.empty((R,), cp.int32),  # [R]
                "topk_w": cp.empty((R,), cp.float32),  # [R]
                "act": cp.empty((R, self.I), cp.float32),  # [R, I]
                "y": cp.empty((R, self.H), cp.float32),  # [R, H]
                "counters": cp.zeros((self.H // 16 + 1,), cp.uint32),  # [H/16 + 1]
            }
            if prefill:
                b["offsets"] = cp.empty((self.E + 1,), cp.int32)  # [E+1]
                b["tile_offsets"] = cp.empty((self.E + 1,), cp.int32)  # [E+1]
                b["sorted"] = cp.empty((R,), cp.int32)  # [R]
        self.bufs, self.routes, self.prefill = b, R, prefill
        self.generation += 1
        log.debug("qmoe_rtc: scratch grown to %d routes (prefill=%s)", R, prefill)

    def view(self, name: str, routes: int):
        return self.bufs[name][:routes]


class QMoE:
    """One quantized MoE layer on the GPU, with ONNX Runtime's QMoE inputs and attributes.

    Expert tensors (inputs 2–13) are keyword arguments with ONNX Runtime's names; attributes too
    (``k``, ``activation_type``, ``expert_weight_bits``, ``block_size``, ``swiglu_fusion`` ...).
    Arrays may be CuPy, torch CUDA tensors (DLPack, zero copy) or NumPy (uploaded once).

    ``decode_max_routes``: rows·k up to which the decode (GEMV) path runs. ``validate_content``:
    also check scales/biases/zero-point padding once (reads the tensors back to the host).
    """

    def __init__(self, *, decode_max_routes: int = DEFAULT_DECODE_MAX_ROUTES, validate_content: bool = False,
                 device: int | None = None, **kwargs):
        cp = _cupy()
        weights = {n: kwargs.pop(n) for n in list(kwargs) if n in WEIGHT_INPUTS}
        for n in list(kwargs):
            if n in INPUT_NAMES:
                raise QMoEInputError(n, "a per-call input: pass it to the layer call, not to QMoE()", "a constructor argument")
        self.attrs = QMoEAttributes.from_kwargs(**kwargs)
        if device is None:
            first = weights.get("fc1_experts_weights")
            device = int(first.device.id) if is_cupy(first) else cp.cuda.runtime.getDevice()
        self.device_id = int(device)
        w = {n: _to_cupy(n, a, self.device_id) for n, a in weights.items()}
        self.layer: LayerSpec = describe_layer(w, self.attrs)
        if self.layer.device_id is not None and self.layer.device_id != self.device_id:
            raise DeviceError(f"weights live on cuda:{self.layer.device_id}, device={self.device_id} was asked for")
        if validate_content:
            check_content(w, self.layer)
        if decode_max_routes < 0:
            raise QMoEInputError("decode_max_routes", "a non-negative integer", str(decode_max_routes))
        self.decode_max_routes = int(decode_max_routes)

        L = self.layer
        with cp.cuda.Device(self.device_id):
            # scales: one dtype for the whole layer (float32 when the projections disagree)
            sdts = {p.scale_dtype for p in L.projections()}
            self.scale_dtype = sdts.pop() if len(sdts) == 1 else "float32"
            if self.scale_dtype == "float32" and len({p.scale_dtype for p in L.projections()}) > 1:
                log.info("qmoe_rtc: projections have scales of different dtypes; converted to float32 once")
            self._proj = {}
            for p in L.projections():
                wt = w[f"{p.name}_experts_weights"]
                if wt.data.ptr % 16:  # the decode kernels read weights with 16-byte loads
                    log.info("qmoe_rtc: %s_experts_weights is not 16-byte aligned; copied once", p.name)
                    wt = wt.copy()
                    w[f"{p.name}_experts_weights"] = wt
                s = w[f"{p.name}_scales"]
                if dtype_name(s) != self.scale_dtype:
                    s = s.astype(cp.float32)
                b = w.get(f"{p.name}_experts_bias")
                z = w.get(f"{p.name}_zero_points")
                self._proj[p.name] = (
                    w[f"{p.name}_experts_weights"],  # [E, N, ceil(K·b/8)] u8
                    _word_readable(cp, cp.ascontiguousarray(s), f"{p.name}_scales"),  # [E, N] / [E, N, nb]
                    None if z is None else _word_readable(cp, z, f"{p.name}_zero_points"),  # packed u8
                    None if b is None else cp.ascontiguousarray(b.astype(cp.float32)),  # [E, N] f32
                )
        self._weights = w  # keep the caller's arrays alive
        self._scratch = _Scratch(L.E, L.H, L.I, self.device_id)
        self._plans: dict = {}
        a = self.attrs
        self._act_scalars = (float(a.activation_alpha), float(a.activation_beta), float(a.swiglu_limit),
                             int(a.swiglu_limit_after_activation))
        self._zp_offset = float(a.zero_point_offset or 0.0)

    # -- layout ----------------------------------------------------------------------------------
    def model_config(self, dtype: str):
        """The :class:`~qmoe_rtc.specialize.ModelConfig` of this layer for activation dtype ``dtype``."""
        from .specialize import Layout, ModelConfig

        L = self.layer
        scale_dtype = self.scale_dtype if self.scale_dtype in ("float32", dtype) else "float32"
        layout = Layout(
            dtype=dtype, scale_dtype=scale_dtype, fc1_bits=L.fc1.bits, fc2_bits=L.fc2.bits,
            fc3_bits=L.fc3.bits if L.fc3 else 0, block_size=self.attrs.block_size, fc1_zp=L.fc1.zp_mode,
            fc2_zp=L.fc2.zp_mode, fc3_zp=L.fc3.zp_mode if L.fc3 else "none", activation=self.attrs.activation_type,
            swiglu_fusion=self.attrs.swiglu_fusion, has_fc3=L.fc3 is not None,
        )
        return ModelConfig(hidden=L.H, inter=L.I, experts=L.E, k=self.attrs.k, layout=layout,
                           use_sparse_mixer=bool(self.attrs.use_sparse_mixer),
                           normalize_routing_weights=bool(self.attrs.normalize_routing_weights))

    # -- plan ------------------------------------------------------------------------------------
    def path_for(self, rows: int) -> str:
        """``"decode"`` (GEMV kernels, no grouping) or ``"prefill"`` (grouped GEMMs) for ``rows`` tokens."""
        L = self.layer
        fits = (L.I + 3) // 4 <= 65535 and (L.H + 3) // 4 <= 65535  # decode grids put I/4 and H/4 on grid.y
        return "decode" if int(rows) * self.attrs.k <= self.decode_max_routes and fits else "prefill"

    def decode_engine(self, rows: int, dtype: str) -> tuple[str, str]:
        """The decode kernels for ``rows`` tokens of ``dtype``: ``("mma", "")`` (tensor cores,
        expert-grouped) or ``("gemv", reason)`` (SIMT) with the reason the mma kernels cannot run."""
        from .kernels.mma import MAX_ROUTES, unsupported_reason

        why = unsupported_reason(self.model_config(dtype).layout, self.layer.H, self.layer.I)
        if why is None and int(rows) * self.attrs.k > MAX_ROUTES:
            why = f"{int(rows) * self.attrs.k} routes (the mma kernels scan at most {MAX_ROUTES})"
        return ("gemv", why) if why else ("mma", "")

    def plan(self, rows: int, dtype: str, router_dtype: str, router_weights_dtype: str | None = None) -> _Plan:
        """Pick the path and load (compile if needed) its kernels; grows the scratch pool.

        Never call it inside graph capture (a compile or an allocation cannot be captured).
        """
        key = (int(rows), dtype, router_dtype, router_weights_dtype)
        plan = self._plans.get(key)
        routes = int(rows) * self.attrs.k
        path = self.path_for(rows)
        if plan is None:
            cp = _cupy()
            if cp.cuda.get_current_stream().is_capturing():
                raise CaptureError(f"no plan for rows={rows}, dtype={dtype}: run one eager call at this shape "
                                   "before capturing")
            if self.scale_dtype not in ("float32", dtype):
                raise QMoEInputError("input", f"dtype {self.scale_dtype} (the layer's scales)", f"dtype {dtype}")
            from .jit import load_module
            from .kernels.route import kernel_key
            from .specialize import modules_for

            config = self.model_config(dtype)
            engine = "gemm"
            families = ("route", "group", "gemv", "gemm")
            if path == "decode":
                engine, why = self.decode_engine(rows, dtype)
                if engine == "mma":
                    families = ("route", "mma")
                else:
                    log.info("qmoe_rtc: decode path at rows=%d uses the SIMT gemv kernels (slower): %s", rows, why)
            mods = {s.family: s for s in modules_for(config, (path,), families=families)}
            kernels = {}
            rk = kernel_key(router_dtype, router_weights_dtype, bool(self.attrs.use_sparse_mixer))
            kernels["route"] = load_module(mods["route"], self.device_id)[rk]
            if engine == "mma":
                from .kernels.mma import route_groups

                m = load_module(mods["mma"], self.device_id)
                ng = route_groups(int(rows))
                kernels["fc1"], kernels["fc2"] = m[f"fc1_ng{ng}"], m[f"fc2_ng{ng}"]
            elif path == "decode":
                m = load_module(mods["gemv"], self.device_id)
                kernels["fc1"], kernels["fc2"] = m["fc1"], m["fc2_combine"]
            else:
                kernels["group"] = load_module(mods["group"], self.device_id)["group_by_expert"]
                m = load_module(mods["gemm"], self.device_id)
                from .kernels.gemm import tile_rows

                bm = tile_rows(routes, self.layer.E)
                kernels["fc1"], kernels["fc2"], kernels["combine"] = m[f"fc1_bm{bm}"], m[f"fc2_bm{bm}"], m["combine"]
            plan = _Plan(path, kernels, mods, engine)
            self._plans[key] = plan
            log.info("qmoe_rtc: planned rows=%d dtype=%s: %s path, %s kernels (%s)", rows, dtype, path, engine,
                     ", ".join(s.name for s in mods.values()))
        self._scratch.ensure(routes, path == "prefill")
        return plan

    # -- run -------------------------------------------------------------------------------------
    def _launches(self, plan: _Plan, rows: int, x, logits, rw, out) -> list:
        """The forward's launches at ``rows``: (function, grid, block, smem, packed args, per-call slots).

        Arguments are checked and packed once here (by each kernel's spec); a call only swaps in its
        own input/output arrays. Rebuilt when the scratch pool has been regrown.
        """
        from .kernels import gemm as gemm_fam
        from .kernels import gemv as gemv_fam
        from .kernels import mma as mma_fam
        from .kernels import route as route_fam
        from .jit.launch import pack_args

        L, a = self.layer, self.attrs
        E, H, I, k = L.E, L.H, L.I, a.k
        R = rows * k
        sc = self._scratch
        ids, wts = sc.view("topk_ids", R), sc.view("topk_w", R)
        kr = plan.kernels
        w1, w2 = self._proj["fc1"], self._proj["fc2"]
        w3 = self._proj.get("fc3", w1)  # without FC3 its slots are never read; FC1's tensors fill the spec
        zpo, acts = self._zp_offset, self._act_scalars
        geo = dict(rows=rows, routes=R, E=E, H=H, I=I, k=k)
        steps = [(kr["route"], route_fam.RouteFamily().launch(None, rows=rows),
                  (logits, rw, rows, E, k, int(a.normalize_routing_weights), ids, wts))]
        if plan.engine == "mma":
            act, y, spec, fam = sc.view("act", R).view(x.dtype), sc.view("y", R), plan.specs["mma"], mma_fam.MmaFamily()
            ks1, _ = fam.geometry(spec, "fc1", routes=R, E=E, H=H, I=I)
            ks2, _ = fam.geometry(spec, "fc2", routes=R, E=E, H=H, I=I)
            steps += [
                (kr["fc1"], fam.launch(spec, "fc1", **geo), (x, ids, R, k, H, I, ks1, *w1, *w3, zpo, *acts, act)),
                (kr["fc2"], fam.launch(spec, "fc2", **geo),
                 (act, ids, wts, R, k, H, I, ks2, *w2, zpo, y, sc.bufs["counters"], out)),
            ]
        elif plan.path == "decode":
            # the decode activation is stored in T: the float32 slot viewed as T ([R, I] of it is used)
            act, spec, fam = sc.view("act", R).view(x.dtype), plan.specs["gemv"], gemv_fam.GemvFamily()
            steps += [
                (kr["fc1"], fam.launch(spec, "fc1", **geo), (x, ids, k, H, I, *w1, *w3, zpo, *acts, act)),
                (kr["fc2"], fam.launch(spec, "fc2_combine", **geo), (act, ids, wts, k, H, I, *w2, zpo, out)),
            ]
        else:
            offsets, tiles, srt = sc.bufs["offsets"], sc.bufs["tile_offsets"], sc.view("sorted", R)
            act, y, spec, fam = sc.view("act", R), sc.view("y", R), plan.specs["gemm"], gemm_fam.GemmFamily()
            steps += [
                (kr["group"], gemm_fam.Launch((1, 1, 1), (1024, 1, 1), 0),
                 (ids, R, E, gemm_fam.tile_rows(R, E), offsets, tiles, srt)),
                (kr["fc1"], fam.launch(spec, "fc1", **geo),
                 (x, srt, offsets, tiles, E, k, H, I, *w1, *w3, zpo, *acts, act)),
                (kr["fc2"], fam.launch(spec, "fc2", **geo), (act, srt, offsets, tiles, E, H, I, *w2, zpo, y)),
                (kr["combine"], fam.launch(spec, "combine", **geo), (y, wts, rows, k, H, out)),
            ]
        per_call = {id(x): "x", id(logits): "logits", id(out): "out"}
        if rw is not None:
            per_call[id(rw)] = "rw"
        items = []
        for kern, launch, args in steps:
            packed = pack_args(kern.kdef, args, self.device_id)
            slots = tuple((i, per_call[id(v)]) for i, v in enumerate(args) if id(v) in per_call)
            kern.reserve_dynamic_smem(launch.shared_mem)  # static + dynamic may pass 48 KiB
            items.append((kern.function, launch.grid, launch.block, int(launch.shared_mem), packed, slots))
        return items

    def _run(self, plan: _Plan, x, logits, rw, out, rows: int, stream) -> None:
        """Launch the forward (capture-safe: launches only, arguments packed at the first run)."""
        cached = plan.launches.get(rows)
        if cached is None or cached[0] != self._scratch.generation:
            cached = (self._scratch.generation, self._launches(plan, rows, x, logits, rw, out))
            plan.launches[rows] = cached
        vals = {"x": x, "logits": logits, "rw": rw, "out": out}
        for fn, grid, block, smem, packed, slots in cached[1]:
            if slots:
                args = list(packed)
                for i, name in slots:
                    args[i] = vals[name]
                packed = tuple(args)
            fn(grid, block, packed, shared_mem=smem, stream=stream)

    def _prepare(self, input, router_probs, router_weights, out):
        cp = _cupy()
        back_to_torch = _is_torch(input)
        x = _to_cupy("input", input, self.device_id)
        logits = _to_cupy("router_probs", router_probs, self.device_id)
        rw = _to_cupy("router_weights", router_weights, self.device_id)
        call = check_call(self.layer, x, logits, rw)
        o = None
        if out is not None:
            o = _to_cupy("out", out, self.device_id)
            if tuple(o.shape) != call.input_shape or dtype_name(o) != call.dtype:
                raise QMoEInputError("out", f"{call.dtype} {shape_str(call.input_shape)} (the input's)",
                                     f"{dtype_name(o)} {shape_str(o.shape)}")
            if not o.flags.c_contiguous:
                raise QMoEInputError("out", "a C-contiguous array", "a non-contiguous view")
        if back_to_torch:
            import torch

            stream = _torch_stream(cp, torch.cuda.current_stream(self.device_id), self.device_id)
        else:
            stream = cp.cuda.get_current_stream()
        if x.data.ptr % 16:  # the decode kernels read activation rows with 16-byte loads
            if stream.is_capturing():
                raise QMoEInputError("input", "a 16-byte aligned array inside graph capture (the kernels read it "
                                     "with 16-byte loads; outside capture it is copied)",
                                     f"an address {x.data.ptr % 16} bytes past a 16-byte boundary")
            with stream:
                x = x.copy()
        return call, x, logits, rw, o, back_to_torch, stream

    def __call__(self, input, router_probs, router_weights=None, out=None):
        """Run the layer: ``input`` [rows, H] or [B, S, H], ``router_probs`` [rows, E] logits.

        Returns the output in the input's shape, dtype and array type (CuPy, or torch for torch
        inputs), on the current stream (torch's current stream for torch inputs).
        """
        cp = _cupy()
        call, x, logits, rw, o, back_to_torch, stream = self._prepare(input, router_probs, router_weights, out)
        with cp.cuda.Device(self.device_id):
            plan = None
            if call.rows:
                plan = self.plan(call.rows, call.dtype, call.router_dtype, call.router_weights_dtype)
            if o is None:
                if stream.is_capturing():
                    raise CaptureError("inside graph capture pass out= (an output cannot be allocated while "
                                       "capturing); or use QMoE.capture()")
                o = cp.empty(call.input_shape, dtype=np_dtype(call.dtype))
            if plan is not None:
                self._run(plan, x, logits, rw, o, call.rows, stream)
        if back_to_torch:
            import torch

            return out if out is not None else torch.from_dlpack(o)
        return o

    # -- graphs ----------------------------------------------------------------------------------
    def capture(self, input, router_probs, router_weights=None) -> "QMoEGraph":
        """Record one forward into a CUDA graph on static copies of the given inputs.

        Plans (compiles, sizes scratch) and runs once eagerly first. The graph's buffers are
        ``graph.input``, ``graph.router_probs``, ``graph.router_weights`` (if given) and
        ``graph.output``; write new values into the inputs, then ``graph.replay()``.
        """
        cp = _cupy()
        call, x, logits, rw, _, _, stream = self._prepare(input, router_probs, router_weights, None)
        with cp.cuda.Device(self.device_id):
            sx, sl = x.copy(), logits.copy()
            srw = None if rw is None else rw.copy()
            so = cp.empty(call.input_shape, dtype=np_dtype(call.dtype))
            if call.rows:
                plan = self.plan(call.rows, call.dtype, call.router_dtype, call.router_weights_dtype)
            cap = cp.cuda.Stream(non_blocking=True)
            cap.wait_event(stream.record())
            if call.rows:
                self._run(plan, sx, sl, srw, so, call.rows, cap)  # eager warm-up on the capture stream
            cap.begin_capture()
            try:
                if call.rows:
                    self._run(plan, sx, sl, srw, so, call.rows, cap)
            finally:
                graph = cap.end_capture()
            cap.synchronize()
        # the graph holds raw pointers into the scratch pool and the weights: keep those buffers alive
        # for as long as the graph lives, even if the layer regrows its pool later
        return QMoEGraph(graph, sx, sl, srw, so, self.device_id, keepalive=(self._scratch.bufs, self._proj))


class QMoEGraph:
    """A captured forward: static ``input`` / ``router_probs`` / ``router_weights`` / ``output``."""

    def __init__(self, graph, x, logits, rw, out, device_id, keepalive=()):
        self.graph = graph
        self._keepalive = keepalive  # buffers the recorded kernels point into
        self.input = x
        self.router_probs = logits
        self.router_weights = rw
        self.output = out
        self.device_id = device_id

    def update(self, input=None, router_probs=None, router_weights=None, stream=None) -> None:
        """Copy new values into the static inputs (same shapes and dtypes) on ``stream``."""
        cp = _cupy()
        for name, dst, src in (("input", self.input, input), ("router_probs", self.router_probs, router_probs),
                               ("router_weights", self.router_weights, router_weights)):
            if src is None:
                continue
            if dst is None:
                raise QMoEInputError(name, "None (the graph was captured without it)", "an array")
            src = _to_cupy(name, src, self.device_id)
            if tuple(src.shape) != tuple(dst.shape) or dtype_name(src) != dtype_name(dst):
                raise QMoEInputError(name, f"{dtype_name(dst)} {shape_str(dst.shape)} (fixed per graph)",
                                     f"{dtype_name(src)} {shape_str(src.shape)}")
            with stream or cp.cuda.get_current_stream():
                dst[...] = src

    def replay(self, stream=None):
        """Launch the graph on ``stream`` (default: the current stream); returns ``output``."""
        cp = _cupy()
        self.graph.launch(stream or cp.cuda.get_current_stream())
        return self.output


def qmoe(input, router_probs, fc1_experts_weights, fc1_scales, fc1_experts_bias=None, fc2_experts_weights=None,
         fc2_scales=None, fc2_experts_bias=None, fc3_experts_weights=None, fc3_scales=None, fc3_experts_bias=None,
         fc1_zero_points=None, fc2_zero_points=None, fc3_zero_points=None, router_weights=None, **attributes):
    """One-shot QMoE on the GPU with ONNX Runtime's input order (0–14) and attribute names.

    Builds a :class:`QMoE` each call (modules stay cached); keep a layer object for repeated use.
    """
    layer = QMoE(fc1_experts_weights=fc1_experts_weights, fc1_scales=fc1_scales, fc1_experts_bias=fc1_experts_bias,
                 fc2_experts_weights=fc2_experts_weights, fc2_scales=fc2_scales, fc2_experts_bias=fc2_experts_bias,
                 fc3_experts_weights=fc3_experts_weights, fc3_scales=fc3_scales, fc3_experts_bias=fc3_experts_bias,
                 fc1_zero_points=fc1_zero_points, fc2_zero_points=fc2_zero_points, fc3_zero_points=fc3_zero_points,
                 **attributes)
    return layer(input, router_probs, router_weights)
