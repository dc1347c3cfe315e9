package gateway

import (
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestCustomerBlocked: a request on behalf of a blocked end customer of
// the key's org (x-sluice-end-user, by external id) is refused with 403
// permission_error customer_blocked naming the header and is accounted
// with the customer's external id; unknown customers, unblocked ones and
// another org's blocked customer of the same external id are served; the
// key's own checks come first.
func TestCustomerBlocked(t *testing.T) {
	t.Parallel()
	sim := startSim(t, nil)
	e := newEnv(t)
	e.snap.Orgs = append(e.snap.Orgs, &configv1.Org{Id: "o2"})
	e.snap.Customers = []*configv1.Customer{
		{Id: "c-blk", OrgId: "o1", ExternalId: "mallory", Blocked: true},
		{Id: "c-ok", OrgId: "o1", ExternalId: "alice"},
		{Id: "c-o2", OrgId: "o2", ExternalId: "bob", Blocked: true},
	}
	tok := e.key("k1", nil)
	keyBlk := e.key("k-blk", func(k *configv1.Key) { k.Blocked = true })
	e.group("g")
	e.deploy("d-g", "g", sim.URL()+"/v1", nil)
	e.apply()

	served := func(customer string) {
		t.Helper()
		resp := e.post(RouteChat, tok, chatBody("g", ""), openai.HeaderEndUser, customer)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, "customer %q", customer)
		ev := e.sink.byID(t, resp.Header.Get(openai.RequestIDHeader))
		require.Equal(t, customer, ev.Customer, "attributed to the external id")
		require.Empty(t, ev.ErrorCode)
		require.Positive(t, ev.CostUsd)
	}
	served("alice")
	served("stranger") // unknown to the org: attribution only
	served("bob")      // blocked in o2, not in the key's org
	served("")         // no header

	refused := func(tok, customer, code, wantCustomer string) {
		t.Helper()
		a := readErr(t, e.post(RouteChat, tok, chatBody("g", ""), openai.HeaderEndUser, customer))
		require.Equal(t, http.StatusForbidden, a.Status)
		require.Equal(t, openai.TypePermission, a.Error.Type)
		require.Equal(t, code, a.Error.Code)
		require.Equal(t, "false", a.Header.Get("X-Should-Retry"))
		require.NotContains(t, a.Error.Message, customer, "the message does not echo the header")
		ev := e.sink.byID(t, a.Header.Get(openai.RequestIDHeader))
		require.Equal(t, int32(http.StatusForbidden), ev.Status)
		require.Equal(t, code, ev.ErrorCode)
		require.Equal(t, wantCustomer, ev.Customer)
		require.Equal(t, "o1", ev.OrgId)
		require.Zero(t, ev.CostUsd)
		require.Zero(t, ev.PromptTokens+ev.CompletionTokens)
		require.Empty(t, ev.DeploymentId, "never forwarded")
	}
	refused(tok, "mallory", openai.CodeCustomerBlocked, "mallory")
	a := readErr(t, e.post(RouteChat, tok, chatBody("g", ""), openai.HeaderEndUser, "mallory"))
	require.Equal(t, openai.HeaderEndUser, deref(a.Error.Param))
	// The key's own block is named first (attribution headers are read
	// after the key).
	refused(keyBlk, "mallory", "key_blocked", "")

	// A block arriving as an event applies to the next request; an
	// unblock restores it.
	blockEv := func(id string, blocked bool) {
		n, err := e.cat.Load().Apply(&configv1.Event{Seq: 1, Change: &configv1.Event_Block{Block: &configv1.BlockChange{
			ObjectType: "customer", Id: id, Blocked: blocked}}}, 1)
		require.NoError(t, err)
		e.cat.Store(n)
	}
	blockEv("c-ok", true)
	refused(tok, "alice", openai.CodeCustomerBlocked, "alice")
	blockEv("c-ok", false)
	served("alice")

	before := len(e.sink.events())
	blockEv("c-blk", false)
	served("mallory")
	// The event is recorded when the exchange finishes, just after the
	// client read the answer.
	require.Eventually(t, func() bool { return len(e.sink.events()) >= before+1 }, 5*time.Second, 2*time.Millisecond)
	require.Len(t, e.sink.events(), before+1, "one usage event per request")
}
