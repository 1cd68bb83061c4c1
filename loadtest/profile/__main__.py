from loadtest.profile.main import main

raise SystemExit(main())
