module tboost.example/embed

go 1.19
