from ditforge.cli import main

raise SystemExit(main())
