package system

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

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
	ten := d.NewTenant("wiped")
	p := d.StartProxy("default", time.Minute)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 5*time.Second)

	d.NATS.Stop()
	d.NATS.Wipe()
	d.NATS.Start()

	// A change after the loss must still reach the data plane.
	c := d.Clients()
	other := d.NewTenant("after-wipe")
	harness.WaitStatus(t, p, other.Token, http.StatusOK, 15*time.Second)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, time.Second)
	_, err := c.Key.BlockKey(context.Background(), connect.NewRequest(&adminv1.BlockKeyRequest{Id: ten.KeyID}))
	require.NoError(t, err)
	harness.WaitStatus(t, p, ten.Token, http.StatusForbidden, 2*time.Second)

	// A data plane that starts now, on the new NATS, gets everything.
	p2 := d.StartProxy("default", time.Minute)
	harness.WaitStatus(t, p2, other.Token, http.StatusOK, 5*time.Second)
	harness.WaitStatus(t, p2, ten.Token, http.StatusForbidden, time.Second)
}
