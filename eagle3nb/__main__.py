from eagle3nb.cli import main

main()
