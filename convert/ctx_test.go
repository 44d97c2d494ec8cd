package convert

import "context"

// ctx is the context of the tests' device calls: none of them is
// cancelled.
var ctx = context.Background()
