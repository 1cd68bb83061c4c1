from loadtest.sweep.main import main

raise SystemExit(main())
