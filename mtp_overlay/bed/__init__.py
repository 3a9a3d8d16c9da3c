"""Test bed: stock megatron-core MTP models on spawned gloo ranks, on a CPU machine (or CUDA).

The product runs it, through two narrow doors: ``mtp-overlay verify`` starts its engine
(``engines.verify``) in a child process, and the CLI's ``demo`` and ``check --run`` import it inside those
commands; no other product module imports it, and importing it imports neither torch nor megatron. It
imports the product, never the other way round, in layers (``tests/contract/test_layers.py``)::

    runtime/   launcher, preloaded interpreters, device (which device), CPU stand-ins, streams, syncs
    oracles/   references from first principles (no megatron-core): packed roll, LLaVA layout, TP shards
    models/    tiny GPT / hybrid / LLaVA builders, Bridge-built models, pipeline stages, packed batches
    steps/     Megatron's step, MoE, Bridge's step, vLLM worker / drafter / serving / chat sessions
    fixes/     each fix's reproducer: its stock code path with the fix off
    engines/   verify's engine, demo, parity, hot path, GPU check, patch measurement

Usage (``fn`` must be a module-level function, its arguments and return value picklable)::

    from mtp_overlay.bed.runtime.launcher import run_ranks, run_ranks_checked
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, make_batch, train_step, cp_slice

    def step(**model_kwargs):               # runs on every rank
        model = build_tiny_gpt(**model_kwargs)  # TP/CP sizes from parallel_state
        return train_step(model, make_batch())  # StepResult of plain floats, same on all ranks

    base = run_ranks_checked(step, 1)[0]
    tp2 = run_ranks_checked(step, 2, tp=2, kwargs=dict(sequence_parallel=True))[0]
    cp2 = run_ranks_checked(step, 2, cp=2)[0]
    assert abs(tp2.lm_loss - base.lm_loss) < 1e-5 and abs(cp2.mtp_loss - base.mtp_loss) < 1e-5

    # a fix off / on in the workers; a failing rank comes back as RankResult.error (traceback text)
    results = run_ranks(step, 2, tp=2, fixes=[], kwargs=dict(
        sequence_parallel=True, scatter_embedding_sequence_parallel=False))
    assert "Sizes of tensors must match" in results[0].error

* ``RankPool(world_size, *, tp=1, cp=1, pp=1, ep=1, etp=None, seed=1234, device="cpu", log=None)``: ranks
  started once (``ep``, ``etp``: expert model / expert tensor parallel sizes; ``etp=None`` is ``tp``),
  ``.run(fn, *, args=(), kwargs=None, fixes=None, timeout=300) -> list[RankResult]`` (rank, value,
  error) as many times as wanted (a failed run restarts the ranks); ``fixes``: None installs what
  ``import mtp_overlay`` installs (the caller's ``MTP_OVERLAY_DISABLE``), a list exactly those
  fixes, ``[]`` none: ranks are born with the overlay off and never import a fix module no run
  asked for; ``log``: a file for the ranks' own output. ``run_ranks(fn, world_size, **options)`` is
  a pool for one run (``fresh=True``: never the shared one); ``run_ranks_checked`` returns the
  values or raises ``RanksFailed`` with every rank's traceback.
* ``build_tiny_gpt(*, seed, sequence_parallel, scatter_embedding_sequence_parallel, mtp_num_layers,
  hidden_size=64, num_attention_heads=4, num_layers=2, vocab_size=128, max_sequence_length=64,
  **config_overrides)``: GPTModel, local spec, RoPE, identical full weights at any TP/CP.
* ``tiny_hybrid.build_tiny_hybrid(*, seed, hybrid_layer_pattern="*-*-/*-", sequence_parallel,
  scatter_embedding_sequence_parallel, ...)``: HybridModel from local modules (attention '*', MLP
  '-', MoE 'E' with megatron-core's MoELayer and SequentialMLP experts, Mamba 'M', MTP depths after
  '/', pipeline stages between '|'); the default pattern holds build_tiny_gpt()'s parameters in order.
  ``build_zoo(**overrides)``: pattern ``ZOO_PATTERN`` with the Super recipe's repeated MTP layer; 4
  experts, top-2, aux loss, alltoall (or allgather) dispatcher; the same weights at every TP / EP size.
* ``moe``: the MTP block's MoE layers (``mtp_moe_layers``), ``is_mtp_layer`` set by hand on them
  (``flag_mtp_moe_layers``, the reference semantics), the aux loss's gradient alone and the logged
  per-layer aux losses through Megatron's step (``aux_loss_gradients``: ``MegatronStep.step(...,
  aux_loss_only=True)``).
* ``pipeline``: under PP (``pp=2``) both tiny builders give this rank's stage holding the PP1 model's
  weights (``build_stage``: built at PP1, loaded by global parameter name), ``global_names``,
  ``stage_keys`` (what a stage's forward gets), ``gather_stages`` (every stage's tensors, by name).
* ``tiny_llava``: megatron-core's own ``LLaVAModel`` with an MTP HybridModel (``build_tiny_llava``:
  pattern ``"*-*-/*-"``, 1-layer CLIP ViT, 32x32 images of 4 embeddings, MLP projector),
  ``make_llava_batch(image_positions)``, ``CombinedIdsReference`` (the language model run directly on
  the hand-built combined ids and mask: the reference an MTP fix for LLaVAModel must equal),
  ``language_model_call`` (the language model called as LLaVAModel calls it), ``build_tiny_mimo``,
  ``build_bridge_omni`` (Bridge 0.6's Nemotron Omni provider, text-only on CPU), ``build_bridge_vl``
  (a Bridge Nemotron VL / Omni provider's own model with images: a CLIP ViT for RADIO, what changed listed).
* ``llava_oracle``: the combined (text + image) layout from first principles, no megatron-core:
  ``combine`` (ids, labels, loss mask, image rows), ``mtp_pairs(layout, depth)`` (what MTP trains),
  ``image_targets`` (pairs that target an image slot), ``shard`` (CP/SP slicing as LLaVAModel's).
* ``packed``: ``make_packed_row(lengths, *, pad_multiple, flavour="padded"|"unpadded", prompts)``
  (NeMo-RL packing; ``PackedSeqParams`` with cu_seqlens_q padded, or real + cu_seqlens_q_padded),
  ``cp_local`` (per-sequence 2*CP chunks), ``SelfSlicingCP`` (takes full rows, slices CP itself,
  returns ``(output, sliced_loss_mask)``), ``run_packed`` / ``run_reference`` (a packed
  forward+backward, or each sequence alone: per-token LM losses, logits, MTP targets/losses/weights
  and full gradients in packed positions), ``expected_mtp`` (what MTP must train, from the text).
* ``make_batch(*, batch_size=2, seq_length=32, vocab_size=128, seed=0)``: full-length dict of
  input_ids, labels, position_ids, loss_mask. ``cp_slice(batch_or_tensor)``: this CP rank's share
  (upstream's load-balanced layout).
* ``train_step(model, batch, **forward_kwargs) -> StepResult``: lm_loss, mtp_losses / mtp_loss,
  mtp_tokens, mtp_acceptance, grad_norm, group_grad_norms, zero_grad_params; identical on all ranks.
  ``batch`` is full-length (CP-sliced inside); ``forward_kwargs`` go to ``GPTModel.forward``
  verbatim (``labels=None``; a ``loss_mask`` for MTP, CP-local via ``cp_slice``). Gradients are
  finalised the way Megatron's schedule does it (see its docstring): TP2+SP matches TP1 in
  everything; CP2 too with mtp-cp-loss-scale on (stock megatron-core normalises each CP rank's MTP
  loss by its own token counts: MTP gradients and the logged MTP loss then differ).
* ``megatron_step.MegatronStep(model, optimizer="megatron"|None)``: Megatron's own training step
  around any built megatron-core language model: DistributedDataParallel, ``get_forward_backward_func()``,
  ``finalize_model_grads``, megatron-core's Adam. ``.step(microbatches, loss="2-output"|"3-output"|
  "nemo-rl", labels=True|False, mtp_grad_scale=None|x|"global-valid-tokens", update=True)`` ->
  ``MegatronStepResult``: lm_loss, logged mtp_losses / mtp_acceptance, mtp_tokens, ``grads``
  ({"mtp", "lm"}: flat TP-gathered numpy arrays, ``relative_error(reference, part)``), grad norms,
  update_norm, MoE ``moe_metrics`` / ``router_grads``; expert-parallel gradients gathered into the
  EP1 order. ``tiny_gpt.train_step`` is its hand-written imitation; both agree at TP1. A microbatch
  may be a packed THD row (``PackedRow.microbatch``: [1, T] tensors plus ``packed_seq_params``, CP-sharded
  per sequence); ``PackedRow.reference_microbatch`` holds each sequence alone (BSHD) for the reference;
  ``mtp_mask="scoped"`` routes the RL MTP mask through ``mtp_overlay.mtp.loss_mask_scope``. A
  microbatch with ``images`` goes whole to a LLaVAModel (or ``CombinedIdsReference``), whose
  returned combined loss mask the loss uses; ``grads["encoder"]`` holds its vision tower's and
  projector's gradients. Under PP the schedule is ``forward_backward_pipelining_without_interleaving``
  (activations over gloo point-to-point; packed rows of different lengths with
  ``config.variable_seq_lengths``), the losses come from the last stage and the gradients from every
  stage, under the PP1 names.
* ``parity``: Megatron's step on model x layout (BSHD, THD padded / unpadded) x parallelism (TP1, CP2,
  TP2+SP, TP2xCP2+SP, EP2, TP2xEP2+SP, PP2, TP2xPP2+SP), stock and with every megatron-core fix, the zoo
  models included (``parity_table`` / ``markdown``: ``scripts/parity.py``), and the
  composition cases of the real path (``composition_cases``, ``expected_outcome``: which fixes a path
  needs; ``scripts/parity.py --compose``).
* ``syncs``: ``SyncCounter`` (``with SyncCounter() as counted: ...``) counts every data-dependent
  host read of a block (``bool(t)``, ``.item()``, ``.tolist()``, ``.nonzero()``, ``torch.equal``,
  boolean indexing, ``.cpu()``, ``torch.cuda.synchronize``, ...: a device sync each on a GPU) by who
  made it, the overlay's product code apart from megatron, the test bed and the rest
  (``counted.overlay``, ``by_origin()``, ``summary()``); ``MegatronStep.schedule_scope = lambda:
  counted`` counts the forward+backward alone; ``checks_mode("full")`` sets ``MTP_OVERLAY_CHECKS``
  for a block.
* ``hot_path``: the host reads of Megatron's step on the packed THD path with every fix installed,
  per layout and step (``run(layout)``: first, warm, BSHD, full checks, stock;
  ``scripts/hot_path_syncs.py`` prints them).
* ``verify``: the engine of ``mtp-overlay verify`` (the same steps as ``parity``, ``parity.run_step``),
  on a user's shrunk config built by Bridge's provider: per case the (sequence, position, target)
  pairs each MTP depth trained and the errors against each sequence alone; the product
  (``mtp_overlay.verification``) runs it as a child process (``python -m mtp_overlay.bed.engines.verify``)
  and judges.
* ``fixes.reproduce(fix_id) -> (bug_shows, evidence)``: a fix's stock path with the fix off
  (``fixes/<fix_id>.py``), for the support matrix, the upstream-tracking tests, ``check --run``.
* ``demo``: the main job (``mtp-overlay demo``); ``patch_images``: what ``scripts/measure_patches.py``
  and the tests measure for the patch manifest.
* ``bridge``: models built through Megatron-Bridge 0.6 providers (``AutoBridge.from_hf_config`` of
  tiny local Qwen3 / NemotronH configs, and a NemotronH config with the zoo's MoE layers and MTP; any
  provider through ``build_provided``); importable without Bridge (``bridge_installed()``);
  ``import_stand_ins()``: Bridge's modules imported by name (a fix's targets: the contract test,
  ``check --run``, the support matrix) through the scoped stand-ins of its missing optional packages.
* ``bridge_step``: Bridge's own ``gpt_step.forward_step`` (or DeepSeek-V4's, ``step=``) through
  ``MegatronStep.run`` (``run_bridge_step``, ``step_state``: what it reads of Bridge's GlobalState),
  and the three Bridge MTP defects as cases a
  fix's test calls with the fix off or on: ``sft_mtp_cases`` (positions trained vs allowed, and a
  direct forward with the mask), ``mtp_off_cases`` / ``omni_finalize`` (``mtp_num_layers: 0``),
  ``export_case`` / ``exported_drafters`` (HF export -> vLLM's real NemotronHMTP).
* vLLM on CPU: ``vllm_serving`` / ``vllm_chat_template`` (an in-process OpenAI server's consumers,
  and the CLI path's), ``vllm_drafter`` (real MTP drafter modules), ``streams`` (CUDA-stream and
  communicator stand-ins for the weight-transfer producer), ``vllm_worker`` (vLLM's own Worker
  weight-update sessions, both model runners and every weight-transfer engine over the tiny NemotronH
  target and its real NemotronHMTP drafter: ``worker_environment()`` yields a ``WorkerBed``;
  ``run_sequence(bed, SEQUENCES["target, target"])`` says per step what changed and what was said;
  ``execute_model_stopped``).
* ``runtime.cpu_shims``: the process-wide table of CPU stand-ins (HybridStack's TE final norm, TE's CP
  and THD attention (``cp_attention``), DDP's stream, the schedule's CUDA tensors, the alltoall MoE
  dispatcher's stream and split sizes, the pipeline's synchronize and embedding-copy ``.cuda()``,
  Mamba's kernels (``mamba_kernels``)), installed by the launcher on CPU; ``cpu_shims()`` context
  manager or ``install()`` / ``uninstall()``. Scoped stand-ins beside it, each for a block
  (``shim.swapped``, and ``shim.scoped_import`` for one importer's import statements):
  ``bridge_stand_ins`` (Bridge's TE and training imports, local MTP spec, host batches),
  ``multimodal_stand_ins`` (LLaVAModel's construction, Bridge's VL / Omni vision tower), and vLLM's
  synchronize (``streams``). ``runtime.device.rank_device()``: the device every builder and step uses.
* ``releases``: other upstream releases side by side (``release_site``, ``copy_installed``,
  ``link_installed``, ``run_with_release``, ``record_sha256``); ``preloaded.run_python``: a fresh
  interpreter forked with torch imported (``fixes=[...]``: a stock one, exactly those fixes
  installed); ``remote_code``: a tiny trust_remote_code model and its Ray round trip.
* pytest, opt-in (``-p mtp_overlay.bed.plugin`` or ``pytest_plugins = [...]`` in a conftest: it
  imports the overlay): ``mtp_run_ranks`` (``run_ranks``), ``mtp_rank_pools`` (one pool per layout for
  the session), and ``@pytest.mark.gpu`` tests skipped without CUDA.

Measured on 2 shared cores: starting ranks costs 5-6 s at TP1, TP2+SP or CP2 and ~13 s at TP2xCP2+SP
when idle (10-20 s under load), almost all of it importing torch and megatron-core; a pool pays it once.
"""
