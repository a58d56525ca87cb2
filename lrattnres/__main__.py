from lrattnres.cli import main

raise SystemExit(main())
