"""``hf-tidar push``: upload a saved model or adapter folder to the Hub in one commit."""

from __future__ import annotations

import argparse
import json

from ..exit_codes import EXIT_OK
from .card import add_card_flags, card_inputs

HELP = "upload a saved model or adapter folder to the Hub in one commit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``push`` flags (the card ones apply when the folder has no README.md)."""
    parser.add_argument("model", help="saved TiDAR / CDLM model folder or gated TiDAR adapter folder")
    parser.add_argument("repo_id", help="Hub repo, owner/name (created if missing); log in with `hf auth login`")
    parser.add_argument("--strategy", default=None, help="default strategy in generation_config.json (default: the model's kind)")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    parser.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.add_argument("--commit-message", default=None, help="the commit's message (default: names the model kind)")
    parser.add_argument("--no-validate", action="store_true", help="skip the Hub's online card validation")
    parser.add_argument("--dry-run", action="store_true", help="list the files that would be uploaded; upload nothing")
    add_card_flags(parser, when="used when MODEL has no README.md")
    parser.add_argument("--json", action="store_true", help="print the uploaded files and commit URL as JSON")


def run(args: argparse.Namespace) -> int:
    """Upload a folder as one commit (or list what would be uploaded with ``--dry-run``)."""
    from ..hub import plan_upload, push

    inputs = card_inputs(args, args.repo_id)
    plan = plan_upload(args.model, inputs, args.strategy)  # fails on bad input before any network access
    result = {"repo_id": args.repo_id, "files": sorted(plan.files), "skipped": plan.skipped, "url": None}
    if not args.dry_run:
        info = push(args.model, args.repo_id, card_inputs=inputs, strategy=args.strategy, private=args.private or None,
                    revision=args.revision, create_pr=args.create_pr, commit_message=args.commit_message,
                    validate_online=not args.no_validate)
        result["url"] = getattr(info, "commit_url", None)
    if args.json:
        print(json.dumps(result))
    else:
        verb = "Would upload" if args.dry_run else "Uploaded"
        print(f"{verb} {', '.join(result['files'])} to {args.repo_id}" + (f" ({result['url']})" if result["url"] else ""))
        if result["skipped"]:
            print(f"Not uploaded (not part of a published model): {', '.join(result['skipped'])}")
    return EXIT_OK
