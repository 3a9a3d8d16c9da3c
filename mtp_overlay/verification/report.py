"""The judge: the engine's measurements against the two references, as a report, JSON and an exit code.

Two references. Numbers: each sequence alone, unpacked, at TP1, stock (the engine's ``reference``
case): every case's LM and per-depth MTP losses and its gradients (relative error of the MTP block,
of each MTP layer, of the rest) against it. Positions: the oracle (`oracle.allowed`), from the tokens
and the mask alone; the reference itself is held to it, so a defect its path shares with the packed
one still shows.

A case's MTP training differs when its step raised, when an MTP depth trained a (position, target)
pair the oracle does not allow or missed one it allows, or when a depth's MTP loss or the MTP
gradients are off the reference by more than the tolerance. The overlay must not differ (exit 1
otherwise). A fix is needed when the overlay without it differs, or differs otherwise than the
overlay (its row says how); a difference the overlay leaves is a possible new defect, shown on the
smallest layout of the search that has it.
"""

from __future__ import annotations

import dataclasses

from .oracle import Triple, allowed, compare, image_slot_targets
from .data import Sample

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

TOLERANCE = 1e-4
OK, DIFFERS = 0, 1  # exit codes (2: bad input, raised before a report exists)


@dataclasses.dataclass(frozen=True)
class Depth:
    """One MTP depth of one case: pairs trained and allowed, the wrong and missed ones, the logged MTP
    loss and its relative error, the MTP gradient's relative error (its own layer's, or the block's when
    the depths share one layer); for a VL / Omni model the trained pairs whose label or predicted slot
    is an image slot (`oracle.image_slot_targets`; None for a language model)."""

    depth: int
    trained: int
    allowed: int
    wrong: tuple[Triple, ...]
    missed: tuple[Triple, ...]
    loss: float | None
    loss_relerr: float | None
    grad_relerr: float | None
    image_targets: int | None = None


@dataclasses.dataclass(frozen=True)
class Case:
    """One step the engine ran: its layout, what it is ("reference", "stock", "overlay", "overlay without
    <fix>"), its fixes, its error or its numbers, and its depths against the two references."""

    layout: str
    name: str
    fixes: tuple[str, ...]
    error: str | None
    lm_loss: float | None
    mtp_losses: tuple[float, ...]
    grad_relerr: dict[str, float]
    max_delta: dict[str, float]
    depths: tuple[Depth, ...]
    tolerance: float

    @property
    def differs(self) -> bool:
        """Its MTP training differs from the references (module docstring)."""
        return bool(self.error) or bool(self.problems())

    def problems(self) -> list[str]:
        """What differs, in words (empty when nothing does)."""
        if self.error:
            return [_error(self.error)]
        found = []
        for depth in self.depths:
            parts = []
            if depth.wrong or depth.missed:
                parts.append(f"{len(depth.wrong)} wrong and {len(depth.missed)} missed (position, target) pairs")
            if depth.image_targets:
                parts.append(f"{depth.image_targets} of them at image slots")
            if depth.loss_relerr is not None and depth.loss_relerr > self.tolerance:
                parts.append(f"MTP loss relerr {depth.loss_relerr:.2g}")
            if depth.grad_relerr is not None and depth.grad_relerr > self.tolerance:
                parts.append(f"MTP gradient relerr {depth.grad_relerr:.2g}")
            if parts:
                found.append(f"depth {depth.depth}: " + ", ".join(parts))
        block = self.grad_relerr.get("mtp")
        if not found and block is not None and block > self.tolerance:
            found.append(f"MTP block gradient relerr {block:.2g}")
        return found

    def signature(self) -> tuple[object, ...]:
        """What tells two differing cases apart (a fix changed something even if both differ)."""
        if self.error:
            return ("error", self.error.split(":", 1)[0])
        return tuple((d.wrong, d.missed, _over(d.loss_relerr, self.tolerance), _over(d.grad_relerr, self.tolerance))
                     for d in self.depths)

    def lm_differs(self) -> bool:
        """The gradients outside the MTP block (the language model's rest; a VL model's vision tower and
        projector) differ from the reference's."""
        rest = [self.grad_relerr[part] for part in ("lm", "encoder") if part in self.grad_relerr]
        return bool(rest) and max(rest) > self.tolerance

    def as_dict(self) -> dict[str, object]:
        return dict(layout=self.layout, case=self.name, fixes=list(self.fixes), error=self.error, lm_loss=self.lm_loss,
                    mtp_losses=list(self.mtp_losses), grad_relerr=self.grad_relerr, max_delta=self.max_delta,
                    differs=self.differs, problems=self.problems(),
                    depths=[dict(depth=d.depth, trained=d.trained, allowed=d.allowed, wrong=[list(t) for t in d.wrong],
                                 missed=[list(t) for t in d.missed], loss=d.loss, loss_relerr=d.loss_relerr,
                                 grad_relerr=d.grad_relerr, image_targets=d.image_targets) for d in self.depths])


@dataclasses.dataclass(frozen=True)
class Need:
    """A fix this config needs: the case that shows why (the overlay without it) and, where that case
    was refused by a fix that reads this one's state, the case without both (what the defect does);
    ``symptom``: what goes wrong on stock, from the fix's declaration; ``required_by``: the fixes of the
    overlay that require it (without it they are not installed either)."""

    fix: str
    case: Case
    deeper: Case | None = None
    symptom: str = ""
    required_by: tuple[str, ...] = ()

    @property
    def why(self) -> str:
        text = "; ".join(self.case.problems())
        if self.deeper is not None:
            others = sorted(set(self.case.fixes) - set(self.deeper.fixes))
            found = "; ".join(self.deeper.problems()) or "equals the references"
            text += f"; without {', '.join(others)} too: {found}"
        return text


@dataclasses.dataclass(frozen=True)
class Report:
    """What ``mtp-overlay verify`` found. ``ok``: the overlay's MTP training equals the references';
    ``exit_code``: 0 then, 1 otherwise. ``layout``: the layout that ran; ``asked``: the layout asked for
    when a smaller one ran instead (above ``--max-ranks``), None when it ran itself: ``ok`` then says
    nothing of the asked one."""

    model: str
    layout: str
    packing: str
    shrunk: dict[str, object]
    built: dict[str, object]
    sample: dict[str, object]
    reference: Case
    stock: Case
    overlay: Case
    ablations: tuple[Case, ...]
    search: tuple[Case, ...]
    needs: tuple[Need, ...]
    not_run: tuple[str, ...]
    notes: tuple[str, ...]
    phases: tuple[tuple[str, float], ...]
    tolerance: float
    asked: str | None = None

    @property
    def ok(self) -> bool:
        return not self.overlay.differs and not self.reference.differs

    @property
    def exit_code(self) -> int:
        return OK if self.ok else DIFFERS

    def new_defects(self) -> list[tuple[str, Case]]:
        """(where, case) of each difference the overlay does not cure: a possible new defect."""
        found = []
        if self.reference.differs:
            found.append(("TP1, each sequence alone, unpacked (the reference path itself)", self.reference))
        if self.overlay.differs:
            smallest = next((case for case in self.search if case.differs), self.overlay)
            found.append((f"{smallest.layout}, {self.packing}", smallest))
        return found

    def as_dict(self) -> dict[str, object]:
        return dict(
            ok=self.ok, exit_code=self.exit_code, model=self.model, layout=self.layout,
            asked_layout=self.asked or self.layout, asked_layout_verified=self.asked is None, packing=self.packing,
            tolerance=self.tolerance, shrunk=self.shrunk, built=self.built, sample=self.sample,
            reference=self.reference.as_dict(), stock=self.stock.as_dict(), overlay=self.overlay.as_dict(),
            without=[case.as_dict() for case in self.ablations], search=[case.as_dict() for case in self.search],
            needs=[dict(fix=need.fix, why=need.why, case=need.case.name, symptom=need.symptom,
                        deeper=None if need.deeper is None else need.deeper.name, required_by=list(need.required_by))
                   for need in self.needs],
            new_defects=[dict(where=where, problems=case.problems(), case=case.as_dict())
                         for where, case in self.new_defects()],
            not_run=list(self.not_run), notes=list(self.notes), phases=[list(phase) for phase in self.phases],
        )

    def text(self) -> str:
        """The report as ``mtp-overlay verify`` prints it."""
        ran = self.layout if self.asked is None else f"{self.layout} (asked: {self.asked}, not run: above --max-ranks)"
        lines = [f"== mtp-overlay verify: {self.model}, {ran}, packing {self.packing}", ""]
        lines += ["what was shrunk (CPU size):"]
        lines += [f"   {c['key']}: {c['original']} -> {c['value']}" + (f"  ({c['why']})" if c["why"] else "")
                  for c in _dicts(self.shrunk.get("shrunk"))] or ["   nothing"]
        lines += [f"   LLaVAModel {c['name']}: {c['bridge']} -> {c['built']}  ({c['why']})"
                  for c in _dicts(self.built.get("substituted"))]
        kept = self.shrunk.get("kept")
        lines += ["what was kept:"] + [f"   {name}: {value}" for name, value in (kept.items() if isinstance(kept, dict)
                                                                               else ())]
        settings = self.shrunk.get("settings")
        if isinstance(settings, dict) and settings:
            lines += ["set for the reference:"] + [f"   {k}: {v}" for k, v in settings.items()]
        provided = _dicts(self.built.get("provider_settings"))
        if provided:
            lines += ["set beyond what the config and Megatron-Bridge's import of it give:"] + [
                f"   {c['field']}: {c['bridge']} -> {c['set']}  ({c['why']})" for c in provided]
        facts = {k: v for k, v in self.built.items() if not isinstance(v, (list, dict))}
        if facts:
            lines += ["built (Megatron-Bridge's provider, stock megatron-core):",
                      "   " + ", ".join(f"{k} {v}" for k, v in facts.items())]
        sequences = _dicts(self.sample.get("sequences"))
        lines += [f"data: {self.sample.get('source')}; {self.sample.get('note')}: "
                  + ", ".join(f"{s['tokens']} tokens (prompt {s['prompt']}" + (f", images at {s['images']}"
                                                                              if s.get("images") else "") + ")"
                              for s in sequences)]
        lines += ["", table(self), ""]
        where = ("combined slots: text tokens and image embeddings, " +
                 f"{self.built.get('tokens_per_image')} per image" if self.built.get("tokens_per_image") else
                 "positions in the sequence, padding at or past its length")
        lines += [f"per MTP depth (pairs: (sequence, position, target); {where}):"]
        for case in (self.reference, self.stock, self.overlay):
            lines += [f"   {case.name}:"] + [f"      {_depth(depth, case)}" for depth in case.depths] if case.depths \
                else [f"   {case.name}: {_error(case.error or '')}"]
        lines += ["", "the overlay without its fixes:"] + [
            f"   {case.name}: " + ("; ".join(case.problems()) if case.differs else "equals the references")
            for case in self.ablations]
        lines += ["", f"fixes this config needs at {self.layout}:"]
        for need in self.needs:
            lines += [f"   {need.fix}: without it, {need.why}"]
            if need.required_by:
                lines += [f"      ({', '.join(need.required_by)} requires it: without it "
                          f"{'that fix is' if len(need.required_by) == 1 else 'those are'} not installed either)"]
            if need.symptom:
                lines += [f"      (on stock: {need.symptom})"]
        if not self.needs:
            lines += ["   none"]
        defects = self.new_defects()
        if defects:
            lines += ["", "POSSIBLE NEW DEFECT (the overlay does not cure it):"]
            for where, case in defects:
                lines += [f"   smallest layout that shows it: {where}"] + [f"   {p}" for p in case.problems()]
                for depth in case.depths:
                    if depth.wrong or depth.missed:
                        lines.append(f"   depth {depth.depth} wrong pairs: {_pairs(depth.wrong)}; missed: "
                                     f"{_pairs(depth.missed)}")
        if self.overlay.lm_differs() and not self.overlay.differs:
            worst = max(self.overlay.grad_relerr.get(part, 0.0) for part in ("lm", "encoder"))
            lines += ["", f"note: the overlay's gradients outside the MTP block differ (relerr {worst:.2g}): not MTP "
                          "training (see the notes)"]
        lines += [""] + [f"not run: {line}" for line in self.not_run] + [f"note: {line}" for line in self.notes]
        lines += ["phases: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)]
        verdict = ("OK: the overlay's MTP training equals the references" if self.ok
                   else "DIFFERS: the overlay's MTP training differs from the references")
        if self.asked is not None:
            verdict += f" at {self.layout}; the asked layout {self.asked} was NOT verified (above --max-ranks)"
        lines += ["", verdict + f" (exit {self.exit_code})"]
        return "\n".join(lines)


def table(report: Report) -> str:
    """The row of the parity table (``scripts/parity.py``) for this config: losses, max |Δgrad|."""
    head = ("| model | layout | parallelism | reference LM / MTP loss | stock LM / MTP loss "
            "| stock max \\|Δgrad\\| MTP / rest | overlay LM / MTP loss | overlay max \\|Δgrad\\| MTP / rest |")
    cells = [report.model, report.packing, report.layout, _losses(report.reference)]
    for case in (report.stock, report.overlay):
        if case.error:
            cells += [_error(case.error), ""]
        else:
            cells += [_losses(case), " / ".join(_delta(case.max_delta.get(part)) for part in ("mtp", "lm"))]
    return "\n".join([head, "|" + " --- |" * 8, "| " + " | ".join(cells) + " |"])


def judge_case(answer: Mapping[str, object], sample: Sample, reference: Mapping[str, object] | None, forward: str,
               depth_count: int, tolerance: float = TOLERANCE, tokens_per_image: int | None = None) -> Case:
    """A `Case` of one engine answer row, held to the oracle and to the ``reference`` row (None: it is
    the reference); ``tokens_per_image``: a VL / Omni model's (positions are combined slots)."""
    error = answer.get("error")
    trained = answer.get("trained")
    losses = tuple(float(x) for x in _floats(answer.get("mtp_losses")))
    reference_losses = losses if reference is None else tuple(float(x) for x in _floats(reference.get("mtp_losses")))
    grads = _numbers(answer.get("grad_relerr"))
    depths = []
    if not error and isinstance(trained, list):
        for index in range(depth_count):
            found = {(int(t[0]), int(t[1]), int(t[2])) for t in trained[index]} if index < len(trained) else set()
            expected = allowed(sample.sequences, index + 1, forward, tokens_per_image)
            wrong, missed = compare(found, expected)
            at_images = None if tokens_per_image is None else \
                len(image_slot_targets(sample.sequences, found, index + 1, tokens_per_image))
            loss = losses[index] if index < len(losses) else None
            base = reference_losses[index] if index < len(reference_losses) else None
            relerr = None if loss is None or not base else abs(loss - base) / abs(base)
            layer = grads.get(f"mtp.layers.{index}", grads.get("mtp"))
            depths.append(Depth(index + 1, len(found), len(expected), tuple(wrong), tuple(missed), loss, relerr, layer,
                                at_images))
    return Case(
        layout=str(answer.get("layout_name", answer.get("layout"))), name=str(answer.get("case")),
        fixes=tuple(str(fix) for fix in _list(answer.get("fixes"))), error=str(error) if error else None,
        lm_loss=_float(answer.get("lm_loss")), mtp_losses=losses, grad_relerr=grads,
        max_delta=_numbers(answer.get("max_delta")),
        depths=tuple(depths), tolerance=tolerance,
    )


def needs(overlay: Case, ablations: tuple[Case, ...] | list[Case], symptoms: dict[str, str] | None = None,
          required_by: dict[str, tuple[str, ...]] | None = None) -> tuple[Need, ...]:
    """The fixes whose absence makes the overlay differ, or differ otherwise (module docstring): each
    ablation that leaves out one fix; one that leaves out two completes the first's row (`Need`)."""
    by_removed = {tuple(sorted(set(overlay.fixes) - set(case.fixes))): case for case in ablations}
    found = []
    for removed, case in by_removed.items():
        if len(removed) != 1 or not case.differs:
            continue
        if overlay.differs and case.signature() == overlay.signature():
            continue
        fix = removed[0]
        deeper = next((other for key, other in by_removed.items() if len(key) == 2 and fix in key), None)
        found.append(Need(fix, case, deeper if case.error else None, (symptoms or {}).get(fix, ""),
                          (required_by or {}).get(fix, ())))
    return tuple(found)


def _depth(depth: Depth, case: Case) -> str:
    loss = "" if depth.loss is None else f", MTP loss {depth.loss:.5f} (relerr {_rel(depth.loss_relerr)})"
    shared = len(case.depths) > 1 and f"mtp.layers.{depth.depth - 1}" not in case.grad_relerr
    scope = " (the MTP block's: one layer for every depth)" if shared else ""
    grad = "" if depth.grad_relerr is None else f", gradient relerr {_rel(depth.grad_relerr)}{scope}"
    images = "" if depth.image_targets is None else f", {depth.image_targets} at image slots"
    text = f"depth {depth.depth}: trained {depth.trained} pairs, the mask allows {depth.allowed}; " \
           f"{len(depth.wrong)} wrong, {len(depth.missed)} missed{images}{loss}{grad}"
    if depth.wrong or depth.missed:
        text += f"\n         wrong: {_pairs(depth.wrong)}\n         missed: {_pairs(depth.missed)}"
    return text


def _pairs(pairs: tuple[Triple, ...], limit: int = 8) -> str:
    shown = ", ".join(f"({s}, {p}, {t})" for s, p, t in pairs[:limit])
    return (shown + f", ... ({len(pairs)} in all)" if len(pairs) > limit else shown) or "none"


def _losses(case: Case) -> str:
    if case.lm_loss is None or not case.mtp_losses:
        return _error(case.error or "no losses")
    return f"{case.lm_loss:.5f} / {case.mtp_losses[0]:.5f}"


def _delta(value: float | None) -> str:
    return "" if value is None else "0" if value == 0 else f"{value:.1e}"


def _rel(value: float | None) -> str:
    return "n/a" if value is None else "0" if value == 0 else f"{value:.1e}"


def _over(value: float | None, tolerance: float) -> bool:
    return value is not None and value > tolerance


def _error(text: str, width: int = 100) -> str:
    first = text.splitlines()[0] if text else ""
    kind = "refused" if first.startswith("ValueError") else "crash"
    return f"{kind}: {first[:width] + '…' if len(first) > width else first}"


def _dicts(value: object) -> list[dict[str, object]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _list(value: object) -> list[object]:
    return list(value) if isinstance(value, (list, tuple)) else []


def _floats(value: object) -> list[float]:
    return [float(x) for x in _list(value) if isinstance(x, (int, float))]


def _numbers(value: object) -> dict[str, float]:
    """The number-valued entries of a JSON object (none for anything else)."""
    items = value.items() if isinstance(value, dict) else ()
    return {str(key): float(number) for key, number in items if isinstance(number, (int, float))}


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None
