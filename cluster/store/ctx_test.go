package store

import "context"

// ctx is the tests' context; the store's calls take none, but helpers
// that start processes do.
var ctx = context.Background()
