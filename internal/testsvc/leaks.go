package testsvc

import "go.uber.org/goleak"

// LeakOptions are the goleak options every package's TestMain uses: the
// goroutines listed here belong to libraries and outlive their owner by
// the library's own design, not by ours.
//
// nats.go's JetStream publisher starts resetPendingAcksOnReconnect at
// the first async publish and the goroutine reads the status channel only
// once it gets the publisher lock; an object store Put (which publishes
// its chunks on a JetStream context of its own and cleans it up on
// return) can reset that channel to nil first, and the goroutine then
// receives from a nil channel for ever. Nothing the owner does stops it.
func LeakOptions() []goleak.Option {
	return []goleak.Option{
		goleak.IgnoreTopFunction("github.com/nats-io/nats.go/jetstream.(*jetStream).resetPendingAcksOnReconnect"),
	}
}
