from lrattnres.train.cli import main

raise SystemExit(main())
