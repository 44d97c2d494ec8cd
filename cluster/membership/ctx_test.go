package membership

import "context"

var ctx = context.Background()
