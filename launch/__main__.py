from rankserve.launch.cli import main

main()
