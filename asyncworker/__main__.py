from asyncworker.cli import main

raise SystemExit(main())
