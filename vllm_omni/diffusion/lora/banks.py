"""Fixed-shape LoRA banks: what a compiled denoiser reads, so that no adapter change recompiles it.

A compiled graph is specialised on everything Python decides while it is traced (dynamo turns each
branch into a guard). The eager LoRA path decides a lot in Python: which slots hold weights, which
rows a scale applies to, whether scales are uniform. A bank moves all of that into tensor contents:

* per LoRA layer, ``A`` rows and ``(s B)^T`` columns for **every** device slot at ``max_rank``, on
  the layer's device (rows beyond an adapter's rank are zero, slots without an adapter are zero);
* one scale table ``[groups, max_rows, max_loras]`` shared by all layers of a manager: row ``n`` of
  group ``g`` holds the scale of every slot for denoiser row (sample) ``n``; group ``0`` is the
  request's scales, groups ``1..`` the per-block multiplied scales of layers a block schedule
  touches; each layer reads the group named by its own ``group`` buffer (a 0-d index tensor).

The delta of a layer is then one shrink over all slots and slices and one expand per output slice::

    h = (x A_bank^T) * scale_row            [rows, L, slices * max_loras * max_rank]
    y[..., slice i] += h_i (s B)_bank_i^T   per output slice i

and a row whose scales are all zero keeps ``y`` unchanged (``torch.where``), so it equals the base
output bit for bit whatever the other rows do. Adapter switches, scale changes, per-step and
per-block schedules, mixed batches and composition only write bank / table contents.

Layout of ``a`` rows: slice-major, then slot, then rank: rows ``((i * max_loras) + j) * max_rank``
onwards hold slot ``j``'s ``A`` rows of output slice ``i`` (a packed layer targeted by its own name
has one ``A``; it is written into every slice's block). ``bt[i]`` rows ``j * max_rank`` onwards hold
slot ``j``'s ``(s B_i)^T``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_omni.diffusion.lora.geometry import LayerGeometry
from vllm_omni.diffusion.lora.ops import bank_expand_
from vllm_omni.diffusion.lora.weights import SlotWeights
from vllm_omni.errors import ConfigError, InvalidAdapterError, InvalidRequestError

#: Denoiser rows (samples, CFG copies included) one compiled activation holds by default.
DEFAULT_BANK_ROWS = 64


class LoRABank(nn.Module):
    """The fixed-shape ``A`` / ``B`` buffers of one LoRA layer and its scale-table index.

    Args:
        geometry: the layer's output slices on this rank (they must tile the local output in order).
        max_loras, max_rank: slots and per-slot rank held.
        table: the manager's shared scale table ``[groups, rows, max_loras]`` float32.
        device, dtype: where and how ``A`` / ``B`` are stored (the layer's LoRA device and dtype).

    Buffers (non-persistent: never in ``state_dict``): ``a`` ``[slices * max_loras * max_rank,
    in_local]``, ``bt_<i>`` ``[max_loras * max_rank, slice_local_size]``, ``group`` (0-d int64),
    ``table`` (shared).

    Raises:
        TypeError: the layer's output slices do not tile its local output in order.
    """

    def __init__(
        self,
        geometry: LayerGeometry,
        max_loras: int,
        max_rank: int,
        table: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        offset = 0
        for sl in geometry.slices:
            if sl.local_offset != offset:
                raise TypeError("LoRA bank: the layer's output slices do not tile its local output in order")
            offset += sl.local_size
        if offset != geometry.out_local:
            raise TypeError("LoRA bank: the output slices do not cover the layer's local output")
        self.geometry = geometry
        self.max_loras = int(max_loras)
        self.max_rank = int(max_rank)
        self.n_slices = len(geometry.slices)
        width = self.max_loras * self.max_rank
        kw = {"device": device, "dtype": dtype}
        self.register_buffer(
            "a", torch.zeros(self.n_slices * width, geometry.in_local, **kw), persistent=False
        )
        for i, sl in enumerate(geometry.slices):
            self.register_buffer(f"bt_{i}", torch.zeros(width, sl.local_size, **kw), persistent=False)
        self.register_buffer(
            "group", torch.zeros((), dtype=torch.long, device=table.device), persistent=False
        )
        self.register_buffer("table", table, persistent=False)

    def bts(self) -> list[torch.Tensor]:
        """``bt_<i>`` for every output slice, in order."""
        return [getattr(self, f"bt_{i}") for i in range(self.n_slices)]

    def nbytes(self) -> int:
        """Bytes of ``a`` and every ``bt_<i>`` (the shared table is not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.a, *self.bts()))

    # ------------------------------------------------------------ writes
    def check(self, weights: SlotWeights) -> str | None:
        """Why ``weights`` do not fit a slot of this bank (a rank above ``max_rank``, a bias delta), else
        ``None``."""
        if weights.bias is not None:
            return (
                "it carries bias deltas (lightx2v diff_b), which compiled banks do not hold (run the stage "
                "with enforce_eager=True, or fuse the file with lora_backend='distill')"
            )
        for _, rank, _, _ in weights.parts:
            if rank > self.max_rank:
                return (
                    f"its LoRA-equivalent rank {rank} exceeds the compiled bank's max rank {self.max_rank} "
                    "(raise max_lora_rank, or run the stage with enforce_eager=True)"
                )
        return None

    @torch.no_grad()
    def write(self, slot: int, weights: SlotWeights) -> None:
        """Copy one adapter's prepared weights (:class:`SlotWeights` on this rank) into ``slot``.

        Raises:
            InvalidAdapterError: see :meth:`check` (the slot is left cleared).
        """
        problem = self.check(weights)
        if problem:
            self.clear(slot)
            raise InvalidAdapterError(problem)
        self.clear(slot)
        r_max, width = self.max_rank, self.max_loras * self.max_rank
        bts = self.bts()
        for (h_start, rank, offset, size), bt in zip(weights.parts, weights.bt, strict=True):
            rows = weights.a[h_start : h_start + rank]
            for i, sl in enumerate(self.geometry.slices):
                lo, hi = max(offset, sl.local_offset), min(offset + size, sl.local_offset + sl.local_size)
                if lo >= hi:
                    continue
                base = (i * width) + slot * r_max
                self.a[base : base + rank].copy_(rows)
                cols = bt[:, lo - offset : hi - offset]
                bts[i][slot * r_max : slot * r_max + rank, lo - sl.local_offset : hi - sl.local_offset].copy_(
                    cols
                )

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        """Zero ``slot`` (its rows of ``a`` in every slice, its rows of every ``bt``)."""
        r_max, width = self.max_rank, self.max_loras * self.max_rank
        for i, bt in enumerate(self.bts()):
            self.a[i * width + slot * r_max : i * width + (slot + 1) * r_max].zero_()
            bt[slot * r_max : (slot + 1) * r_max].zero_()

    # ------------------------------------------------------------ forward
    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus every slot's scaled delta; rows whose scales are all zero come back unchanged.

        Traced by dynamo: reads only tensors (and shapes), never their values. Each slot's columns
        of ``h`` are zero in the rows where its scale is zero (``torch.where`` on the small ``h``,
        so even an inf or NaN in that slot's ``x A^T`` stays out), hence a row whose scales are all
        zero gets a delta of exact zeros: adapters with a NaN or inf weight, or whose shrink or
        update overflows the layer's dtype, are refused when they load
        (:func:`~vllm_omni.lora.adapter_files.update_range_problem`), and ``y + 0`` is ``y``.

        Args:
            x: layer input on this rank, ``[rows, ..., in_local]`` (rows: denoiser samples).
            y: layer output on this rank before any collective, ``[rows, ..., out_local]``; updated
                in place (and returned) when it is contiguous and of the bank's dtype, which the
                output of the base GEMM is.

        Returns:
            ``y`` with the delta added (a new tensor when ``y`` could not be updated in place).
        """
        rows = x.shape[0]
        scales = self.table.index_select(0, self.group.reshape(1))[0, :rows]  # [rows, max_loras] float32
        a = self.a
        # 2-D GEMMs throughout: a column block of a 2-D ``h`` is a strided matrix BLAS reads in place,
        # where a slice of a 3-D ``h`` made the expand a batched matmul over copies
        x2 = x.reshape(-1, x.shape[-1])
        h = F.linear(x2 if x2.dtype == a.dtype else x2.to(a.dtype), a)  # [rows * L, slices * width]
        coef = scales.to(a.dtype)[:, None, :, None].expand(rows, self.n_slices, self.max_loras, self.max_rank)
        coef = coef.reshape(rows, 1, a.shape[0])
        # a select, not only a product: a slot whose scale is 0 in a row contributes exact zeros to
        # that row whatever its shrink holds (inf * 0 would be NaN), so no slot reaches rows or
        # slots that do not use it
        h = torch.where(coef != 0, h.view(rows, -1, a.shape[0]) * coef, 0).view(-1, a.shape[0])
        if y.dtype == a.dtype and y.is_contiguous():
            bank_expand_(y.view(-1, y.shape[-1]), h, self.bts())
            return y
        width = self.max_loras * self.max_rank
        parts = [h[:, i * width : (i + 1) * width] @ bt for i, bt in enumerate(self.bts())]
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y + delta.view(y.shape).to(y.dtype)


class LoRABankSet:
    """The banks of one manager's layers and their shared scale table (the manager's bank mode).

    Args:
        wrappers: the manager's LoRA layers by qualified name.
        max_loras: device slots.
        rows: denoiser rows (samples, CFG copies included) one activation may hold.

    Attributes:
        table: ``[1 + len(wrappers), rows, max_loras]`` float32 on the layers' device; group ``g``
            of a layer is ``wrappers[name].lora_bank.group``.

    Raises:
        ConfigError: ``rows < 1``, or the layers' LoRA devices differ.
        TypeError: a layer whose output slices cannot be banked.
    """

    def __init__(self, wrappers: dict, max_loras: int, rows: int = DEFAULT_BANK_ROWS) -> None:
        if not isinstance(rows, int) or rows < 1:
            raise ConfigError(f"bank rows must be an integer >= 1, got {rows!r}")
        devices = {w.lora_device for w in wrappers.values()}
        if len(devices) > 1:
            raise ConfigError(
                f"compiled LoRA banks need one LoRA device for all layers, got {sorted(map(str, devices))}"
            )
        device = next(iter(devices), torch.device("cpu"))
        self.rows = rows
        self.max_loras = max_loras
        self.table = torch.zeros(1 + len(wrappers), rows, max_loras, dtype=torch.float32, device=device)
        self.wrappers = wrappers
        self.banks = {name: w.enable_bank(self.table) for name, w in wrappers.items()}
        self._grouped: set[str] = set()

    def nbytes(self) -> int:
        """Bytes of every bank's ``A`` / ``B`` buffers plus the scale table."""
        return sum(b.nbytes() for b in self.banks.values()) + self.table.numel() * 4

    def check_adapter(self, prepared: dict) -> tuple[str, str] | None:
        """``(layer, reason)`` for the first layer whose bank cannot hold the adapter, else ``None``.

        Args:
            prepared: layer name -> :class:`SlotWeights` of one adapter.
        """
        for name, weights in prepared.items():
            problem = self.banks[name].check(weights)
            if problem:
                return name, problem
        return None

    def check_rows(self, rows: int) -> None:
        """Raises :class:`~vllm_omni.errors.InvalidRequestError` when ``rows`` exceed the table."""
        if rows > self.rows:
            raise InvalidRequestError(
                f"the batch has {rows} denoiser rows (prompts x images per prompt x 2 with CFG); the compiled "
                f"LoRA bank holds {self.rows} (lower max_batch_size or num_images_per_prompt)"
            )

    @torch.no_grad()
    def publish(self, matrix: torch.Tensor, groups: list[tuple[torch.Tensor, list[str]]]) -> None:
        """Write one activation's scales: ``matrix`` ``[batch, max_loras]`` (one row: every row of
        the batch) into group 0, each ``(matrix, layer names)`` of ``groups`` into groups ``1..``."""
        host = torch.zeros(1 + len(groups), self.rows, self.max_loras, dtype=torch.float32)
        for g, values in enumerate([matrix] + [m for m, _ in groups]):
            host[g, : values.shape[0]] = values
            if values.shape[0] == 1:
                host[g, 1:] = values
        self.table[: host.shape[0]].copy_(host)
        named = {name: g + 1 for g, (_, names) in enumerate(groups) for name in names}
        for name in self._grouped - set(named):
            self.banks[name].group.fill_(0)
        for name, g in named.items():
            self.banks[name].group.fill_(g)
        self._grouped = set(named)
