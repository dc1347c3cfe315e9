package dataplane

import (
	"log/slog"

	"github.com/nats-io/nats.go"

	"github.com/sluicegw/sluice/proto/wire"
)

// natsReleases carries deployment-slot release notifications between the
// fleet's proxies over core NATS (admission.Releases; docs/traffic.md,
// "Wake-up"): at most once, no persistence. A lost notification costs a
// waiter at most one admission retry interval.
type natsReleases struct {
	nc  *nats.Conn
	log *slog.Logger
}

// Publish announces a released slot of group; an error (connection gone)
// is dropped: the waiters' retry interval covers it.
func (r natsReleases) Publish(group string) {
	_ = r.nc.Publish(wire.AdmissionReleaseSubject(group), []byte(group))
}

// Watch subscribes to group's releases until stop.
func (r natsReleases) Watch(group string, wake func()) (stop func()) {
	sub, err := r.nc.Subscribe(wire.AdmissionReleaseSubject(group), func(m *nats.Msg) {
		if string(m.Data) == group { // not another group of the same hash
			wake()
		}
	})
	if err != nil {
		r.log.Warn("admission: cannot subscribe to the fleet's slot releases; waiters retry on their interval", "model_group", group, "error", err)
		return func() {}
	}
	return func() { _ = sub.Unsubscribe() }
}
