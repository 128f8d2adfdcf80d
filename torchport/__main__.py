"""``python -m torchport`` runs the CLI."""

from torchport.cli import main

raise SystemExit(main())
