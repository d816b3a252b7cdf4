/* The checks of the plain C test programs (test_c_api.c, test_params.c): each counts, and a failed one says where on
 * stderr and is counted in `failures`, so that a program reports every failure of a run, not the first. */
#ifndef KVRET_TESTS_C_CHECK_H
#define KVRET_TESTS_C_CHECK_H

#include <stdio.h>

#include "kvret.h"

static int failures = 0;
static int checks = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    ++checks;                                                                  \
    if (!(cond)) {                                                             \
      ++failures;                                                              \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                          \
  } while (0)

#define CHECK_OK(call)                                                                             \
  do {                                                                                             \
    kvret_status s_ = (call);                                                                      \
    ++checks;                                                                                      \
    if (s_ != KVRET_OK) {                                                                          \
      ++failures;                                                                                  \
      fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call, kvret_status_string(s_), \
              kvret_last_error());                                                                 \
    }                                                                                              \
  } while (0)

#endif
