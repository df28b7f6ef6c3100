"""Notes on options a switch makes moot: logged once per config, never errors.

Each of ``cudagraph_mode``'s graphless values, ``decoder_replay=false`` and
``cudagraph_decoder_replay=false`` is a kill switch, meant to be flipped alone while
every other option stays as it was (docs/debugging.md), and the benchmark runs one set
of options under every mode; so an option a switch turns off is noted, not refused.
"""
from __future__ import annotations


def notes(cfg) -> list[str]:
    """Options the caller set that a switch makes moot: one line each, naming the
    option and the switch (docs/configuration.md, Options a switch turns off). They
    are notes, not errors: each switch is a kill switch, meant to be flipped alone
    while every other option stays as it was (docs/debugging.md), and the benchmark
    runs one set of options under every mode."""
    given = cfg.given()
    # The switches that are off, each with what that turns off.
    no_graphs = ("cudagraph_mode='none'", "every step is eager: no graph is captured") \
        if not cfg.graphs_enabled else None
    no_full = (f"cudagraph_mode={cfg.cudagraph_mode!r}", "no FULL graph is captured") \
        if not cfg.full_graphs else None
    no_pieces = (f"cudagraph_mode={cfg.cudagraph_mode!r}", "no piecewise graph is captured, so no step "
                 "trims in graphs") if cfg.graphs_enabled and not cfg.piecewise_graphs else None
    no_region = ("decoder_replay=False", "the replay layers stay in the main graph: nothing trims") \
        if not cfg.decoder_replay else None
    no_replay_graphs = ("cudagraph_decoder_replay=False", "no replay graph is captured and PIECEWISE "
                        "steps never trim") if not cfg.cudagraph_decoder_replay else None
    replay = (no_graphs, no_pieces, no_region, no_replay_graphs)
    # The threshold and max_num_seqs also bound the FULL sizes (full_capture_sizes).
    sizes_too = (no_graphs, no_region, no_replay_graphs) if cfg.full_graphs else replay
    explicit_sizes = ("decoder_replay_cudagraph_capture_sizes set", "max_num_seqs only bounds the "
                      "default replay sizes") if cfg.decoder_replay_cudagraph_capture_sizes else None
    # option: (whether its value asks for something, the switches that deny it)
    asks = {
        "cudagraph_capture_sizes": (True, (no_graphs,)),
        "max_cudagraph_capture_size": (True, (no_graphs,)),
        "debug_check_addresses": (cfg.debug_check_addresses, (no_graphs,)),
        "cudagraph_decoder_replay": (cfg.cudagraph_decoder_replay, (no_graphs, no_pieces, no_region)),
        "decoder_replay_cudagraph_capture_sizes": (True, replay),
        "decoder_replay_trim_threshold": (True, sizes_too),
        "trim_io_graphs": (cfg.trim_io_graphs, replay),
        "max_num_seqs": (True, (*sizes_too, explicit_sizes)),
        "uniform_decode_query_len": (True, (no_full,)),
    }
    notes = []
    for key, (asking, switches) in asks.items():
        off = next((sw for sw in switches if sw is not None), None)
        if key in given and asking and off is not None:
            notes.append(f"dsv41_replay: option {key}={getattr(cfg, key)!r} has no effect with {off[0]} "
                         f"({off[1]})")
    # FULL graphs read their steps' metadata in the buffer too: the option matters to them.
    if "metadata_in_place" in given and cfg.metadata_in_place and not cfg.full_graphs:
        no_io = ("trim_io_graphs=False", "the trim op's gathers stay eager ops") if not cfg.trim_io_graphs \
            else None
        off = next((sw for sw in (*replay, no_io) if sw is not None), None)
        if off is not None:
            notes.append(f"dsv41_replay: option metadata_in_place=True: no trim graph reads the metadata in "
                         f"place with {off[0]} ({off[1]}); served steps' metadata still shares one buffer")
    if "metadata_in_place" in given and not cfg.metadata_in_place and cfg.full_graphs:
        notes.append(f"dsv41_replay: option metadata_in_place=False: cudagraph_mode={cfg.cudagraph_mode!r} captures "
                     "no FULL graph (a FULL graph reads its steps' metadata where the backend's buffer holds it), "
                     "a counted fallback at capture")
    if cfg.inductor_mode == "max-autotune-no-cudagraphs" and cfg.graphs_enabled:
        notes.append("dsv41_replay: mode='max-autotune-no-cudagraphs' autotunes the pieces and keeps "
                     "Inductor's own graphs off; this backend's graphs follow option "
                     "cudagraph_mode='piecewise' (set cudagraph_mode='none' for none)")
    return notes
