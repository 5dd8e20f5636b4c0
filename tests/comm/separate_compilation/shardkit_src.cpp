// The one translation unit of the program that compiles shardkit's separately compiled bodies.
#include <shardkit/impl/src.hpp>
