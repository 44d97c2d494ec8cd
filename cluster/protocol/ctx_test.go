package protocol

import "context"

// ctx is the context of the tests' calls that are not cancelled.
var ctx = context.Background()
