"""``overlay workspace-plan``: the direct DCP workspaces' capacity and bytes, and the gathered W_UV, per GPU."""

from __future__ import annotations

import argparse
import json
import sys

from overlay.commands.common import add_vllm

HELP = ("capacity (tokens) and bytes per GPU of the direct DCP q-gather and A2A workspaces and of the "
        "DCP-gathered W_UV (project-before-merge), from flags or a regress profile")


def configure_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("workspace-plan", help=HELP, description=HELP)
    add_vllm(sp)
    sp.add_argument("--profile", help="regress profile name or YAML: TP, DCP, batching, speculation from its "
                                      "serve arguments, the projection from its --dcp-v-up-proj-before-merge "
                                      "auto|on|off (0.34.0's; auto resolved for its --dcp-comm-backend and "
                                      "VLLM_USE_DIRECT_DCP_A2A) or its env VLLM_DCP_PROJECT_BEFORE_MERGE "
                                      "(0.28.0's), never both (flags override)")
    sp.add_argument("--tp", type=int, help="tensor parallel size (default 8)")
    sp.add_argument("--dcp", type=int, help="decode context parallel size (default 8)")
    sp.add_argument("--num-heads", type=int, help="attention heads of the model (default 64, GLM-5)")
    sp.add_argument("--kv-lora-rank", type=int, help="default 512")
    sp.add_argument("--rope-dim", type=int, help="qk_rope_head_dim (default 64)")
    sp.add_argument("--v-head-dim", type=int, help="v_head_dim (default 256, GLM-5)")
    sp.add_argument("--num-layers", type=int,
                    help="MLA layers, each with its own W_UV_dcp (default 78, GLM-5; an MTP draft's layer is one more)")
    sp.add_argument("--project-before-merge", action=argparse.BooleanOptionalAction, default=None,
                    help="the projection through W_UV before the DCP merge, whatever the build's switch "
                         "(default on, or the profile's): the A2A output at v_head_dim and W_UV gathered over "
                         "DCP; off: at kv_lora_rank, no gathered W_UV")
    sp.add_argument("--max-num-seqs", type=int,
                    help="default 128 (the seed's setup; a profile without the flag: vLLM's 1024)")
    sp.add_argument("--speculative-tokens", type=int, help="num_speculative_tokens (default 0)")
    sp.add_argument("--parallel-drafting", action=argparse.BooleanOptionalAction, default=None,
                    help="speculative parallel drafting (2 tokens per draft position)")
    sp.add_argument("--max-num-batched-tokens", type=int, help="default 8192")
    sp.add_argument("--cudagraph-capture-size", type=int,
                    help="max cudagraph capture size (default: vLLM's, min(seqs x (1 + spec) x 2, 512))")
    sp.add_argument("--num-ubatches", type=int, help="DBO micro-batches (default 1)")
    sp.add_argument("--query-dtype-bytes", type=int, help="2 (bf16, default) or 1 (fp8 query)")
    sp.add_argument("--q-padded-heads", type=int, help="query heads the backend pads to (default DCP x H)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(handler=cmd_workspace_plan)


def cmd_workspace_plan(ns: argparse.Namespace) -> int:
    from overlay.errors import OverlayError
    from overlay.regress.workspace_plan import build_config, format_plan, plan

    try:
        config = build_config(
            ns.profile, tp=ns.tp, dcp=ns.dcp, num_heads=ns.num_heads, kv_lora_rank=ns.kv_lora_rank,
            qk_rope_head_dim=ns.rope_dim, v_head_dim=ns.v_head_dim, num_layers=ns.num_layers,
            project_before_merge=ns.project_before_merge, max_num_seqs=ns.max_num_seqs,
            speculative_tokens=ns.speculative_tokens, parallel_drafting=ns.parallel_drafting,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            cudagraph_capture_size=ns.cudagraph_capture_size, num_ubatches=ns.num_ubatches,
            query_dtype_bytes=ns.query_dtype_bytes, q_padded_heads=ns.q_padded_heads)
    except ValueError as exc:
        raise OverlayError(str(exc)) from None
    result = plan(config)
    if ns.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        sys.stdout.write(format_plan(result))
    return 0
