from loadtest.soak.main import main

raise SystemExit(main())
