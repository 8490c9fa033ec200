from q27py.cli import main

raise SystemExit(main())
