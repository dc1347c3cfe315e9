package dataplane

import (
	"context"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// TestNATSDataLossRecovers: NATS comes back empty (wiped store) while
// Postgres remembers every region's stream position. The publisher must
// realign the streams, compile a fresh snapshot and keep publishing; data
// planes must resync and enforce later changes.
func TestNATSDataLossRecovers(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ten := d.mkTenant("wiped")
	p := d.startProxy("default", time.Minute)
	waitStatus(t, p, ten.Token, http.StatusOK, 5*time.Second)

	d.nats.Stop()
	d.nats.Wipe()
	d.nats.Start()

	// A change after the loss must still reach the data plane.
	c := d.clients()
	other := d.mkTenant("after-wipe")
	waitStatus(t, p, other.Token, http.StatusOK, 15*time.Second)
	waitStatus(t, p, ten.Token, http.StatusOK, time.Second)
	_, err := c.Key.BlockKey(context.Background(), connect.NewRequest(&adminv1.BlockKeyRequest{Id: ten.KeyID}))
	require.NoError(t, err)
	waitStatus(t, p, ten.Token, http.StatusForbidden, 2*time.Second)

	// A data plane that starts now, on the new NATS, gets everything.
	p2 := d.startProxy("default", time.Minute)
	waitStatus(t, p2, other.Token, http.StatusOK, 5*time.Second)
	waitStatus(t, p2, ten.Token, http.StatusForbidden, time.Second)
}
