package catalog

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

func customerSnapshot() *configv1.Snapshot {
	return &configv1.Snapshot{
		Version: 1, Orgs: []*configv1.Org{{Id: "org_a"}, {Id: "org_b"}},
		Customers: []*configv1.Customer{
			{Id: "cus_1", OrgId: "org_a", ExternalId: "acme-42"},
			{Id: "cus_2", OrgId: "org_a", ExternalId: "globex", Blocked: true},
			// The same external id in another org is another customer.
			{Id: "cus_3", OrgId: "org_b", ExternalId: "acme-42", Blocked: true},
		},
	}
}

func apply(t *testing.T, c *Catalog, seq uint64, ev *configv1.Event) *Catalog {
	t.Helper()
	ev.Seq = seq
	n, err := c.Apply(ev, seq)
	require.NoError(t, err)
	return n
}

// customerIDOf returns the id of the indexed customer ("" for none) and
// whether it is blocked.
func customerIDOf(c *Catalog, org, ext string) (string, bool) {
	cu := c.Customer(org, ext)
	return cu.GetId(), cu.GetBlocked()
}

func TestCustomerIndexFromSnapshot(t *testing.T) {
	t.Parallel()
	c, err := FromSnapshot(customerSnapshot(), 0, nil)
	require.NoError(t, err)
	for _, tc := range []struct {
		org, ext string
		id       string
		blocked  bool
	}{
		{"org_a", "acme-42", "cus_1", false},
		{"org_a", "globex", "cus_2", true},
		{"org_b", "acme-42", "cus_3", true},
		{"org_b", "globex", "", false},   // other org's customer: unknown here
		{"org_a", "cus_1", "", false},    // the internal id is not an external id
		{"org_a", "ACME-42", "", false},  // exact match
		{"org_c", "acme-42", "", false},  // no such org
		{"org_a", "", "", false},         // no header
		{"", "acme-42", "", false},       // no org
		{"org_a", "acme-42 ", "", false}, // no trimming
	} {
		id, blocked := customerIDOf(c, tc.org, tc.ext)
		require.Equal(t, tc.id, id, "%q/%q", tc.org, tc.ext)
		require.Equal(t, tc.blocked, blocked, "%q/%q", tc.org, tc.ext)
	}
}

// TestCustomerIndexFollowsEvents: block/unblock, upsert (including an
// external id change), delete and re-create keep the index equal to the
// customers, and every Apply leaves its receiver untouched.
func TestCustomerIndexFollowsEvents(t *testing.T) {
	t.Parallel()
	c0, err := FromSnapshot(customerSnapshot(), 0, nil)
	require.NoError(t, err)

	block := func(id string, b bool) *configv1.Event {
		return &configv1.Event{Change: &configv1.Event_Block{Block: &configv1.BlockChange{ObjectType: "customer", Id: id, Blocked: b}}}
	}
	c1 := apply(t, c0, 1, block("cus_1", true))
	id, blocked := customerIDOf(c1, "org_a", "acme-42")
	require.Equal(t, "cus_1", id)
	require.True(t, blocked, "blocked by the event")
	_, blocked = customerIDOf(c0, "org_a", "acme-42")
	require.False(t, blocked, "the previous catalog is not modified")
	_, blocked = customerIDOf(c1, "org_b", "acme-42")
	require.True(t, blocked, "org_b's customer of the same external id is untouched")

	c2 := apply(t, c1, 2, block("cus_2", false))
	_, blocked = customerIDOf(c2, "org_a", "globex")
	require.False(t, blocked, "unblocked")
	_, blocked = customerIDOf(c1, "org_a", "globex")
	require.True(t, blocked)

	// A block of an unknown customer changes nothing.
	c3 := apply(t, c2, 3, block("cus_404", true))
	require.Equal(t, 3, c3.Counts()["customers"])

	// Upsert with a new external id: the old name no longer resolves.
	c4 := apply(t, c3, 4, &configv1.Event{Change: &configv1.Event_Customer{Customer: &configv1.Customer{
		Id: "cus_1", OrgId: "org_a", ExternalId: "acme-43", Blocked: true}}})
	id, _ = customerIDOf(c4, "org_a", "acme-42")
	require.Empty(t, id, "renamed away")
	id, blocked = customerIDOf(c4, "org_a", "acme-43")
	require.Equal(t, "cus_1", id)
	require.True(t, blocked)
	id, _ = customerIDOf(c3, "org_a", "acme-42")
	require.Equal(t, "cus_1", id, "the previous catalog still resolves the old name")

	// A new customer.
	c5 := apply(t, c4, 5, &configv1.Event{Change: &configv1.Event_Customer{Customer: &configv1.Customer{
		Id: "cus_4", OrgId: "org_b", ExternalId: "initech"}}})
	id, _ = customerIDOf(c5, "org_b", "initech")
	require.Equal(t, "cus_4", id)
	id, _ = customerIDOf(c4, "org_b", "initech")
	require.Empty(t, id)

	// Delete, then an external id taken over by another customer, then
	// the delete of the first must not remove the second from the index.
	c6 := apply(t, c5, 6, &configv1.Event{Change: &configv1.Event_CustomerDeleted{CustomerDeleted: "cus_2"}})
	id, _ = customerIDOf(c6, "org_a", "globex")
	require.Empty(t, id, "deleted")
	id, _ = customerIDOf(c5, "org_a", "globex")
	require.Equal(t, "cus_2", id)
	c7 := apply(t, c6, 7, &configv1.Event{Change: &configv1.Event_Customer{Customer: &configv1.Customer{
		Id: "cus_5", OrgId: "org_a", ExternalId: "globex", Blocked: true}}})
	c8 := apply(t, c7, 8, &configv1.Event{Change: &configv1.Event_CustomerDeleted{CustomerDeleted: "cus_2"}}) // again: no-op
	id, blocked = customerIDOf(c8, "org_a", "globex")
	require.Equal(t, "cus_5", id)
	require.True(t, blocked)
	c9 := apply(t, c8, 9, &configv1.Event{Change: &configv1.Event_CustomerDeleted{CustomerDeleted: "cus_404"}})
	require.Equal(t, c8.Counts(), c9.Counts())

	// The catalog built incrementally equals one built from the final
	// state, index included.
	final, err := FromSnapshot(&configv1.Snapshot{Version: 2, Orgs: customerSnapshot().Orgs, Customers: []*configv1.Customer{
		{Id: "cus_1", OrgId: "org_a", ExternalId: "acme-43", Blocked: true},
		{Id: "cus_3", OrgId: "org_b", ExternalId: "acme-42", Blocked: true},
		{Id: "cus_4", OrgId: "org_b", ExternalId: "initech"},
		{Id: "cus_5", OrgId: "org_a", ExternalId: "globex", Blocked: true},
	}}, 0, nil)
	require.NoError(t, err)
	require.NoError(t, c9.Equal(final))
	requireSameIndex(t, final, c9)
}

// requireSameIndex compares the external-id indexes of two catalogs and
// checks each against its customers map.
func requireSameIndex(t *testing.T, want, got *Catalog) {
	t.Helper()
	require.Len(t, got.byExternal, len(want.byExternal))
	for k, cu := range want.byExternal {
		require.True(t, proto.Equal(cu, got.byExternal[k]), "%+v", k)
	}
	for _, c := range []*Catalog{want, got} {
		require.Len(t, c.byExternal, len(c.customers))
		for id, cu := range c.customers {
			require.Same(t, cu, c.byExternal[customerKeyOf(cu)], id)
		}
	}
}
