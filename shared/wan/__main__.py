from shared.wan.cli import main

raise SystemExit(main())
