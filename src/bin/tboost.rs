fn main() {
    tboost::cli::main()
}
