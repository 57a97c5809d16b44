"""Push a finished run to the Hugging Face Hub: its exported model (config, weights or PEFT adapter,
tokenizer), results and loss plot, with a generated model card.

    jaxseq push out/sst2 my-name/minilm-sst2 [--hub_private_repo] [--hub_token TOKEN]
    jaxseq push out/sst2 my-name/minilm-sst2 --hub_dry_run   # stage in out/sst2/hub_dry_run

The token defaults to HF_TOKEN or the login `hf auth login` stored; it is never printed or written.
The same happens at the end of training with --push_to_hub.
"""

from __future__ import annotations

from jaxseq.cli import script
from jaxseq.config import build_parser
from jaxseq.hub_push import DRY_RUN_DIR, HubConfig, push_run


@script
def main(argv) -> int:
    parser = build_parser(__doc__)
    parser.add_argument("output_dir", help="--output_dir of a finished training run")
    parser.add_argument("repo_id", help="Hub repo, 'user/name' or 'name' in your namespace")
    parser.add_argument("--hub_private_repo", action="store_true", help="create the repo private")
    parser.add_argument("--hub_token", default=None, help="Hub token (default: HF_TOKEN or the stored login)")
    parser.add_argument(
        "--hub_dry_run",
        action="store_true",
        help=f"stage exactly what would be uploaded in OUTPUT_DIR/{DRY_RUN_DIR}; upload nothing",
    )
    args = parser.parse_args(argv)
    hub = HubConfig(
        push_to_hub=True,
        hub_model_id=args.repo_id,
        hub_private_repo=args.hub_private_repo,
        hub_token=args.hub_token,
        hub_dry_run=args.hub_dry_run,
    )
    push_run(hub, args.output_dir)
    return 0
