package catalog

import (
	"testing"

	"github.com/stretchr/testify/require"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// labelIDs returns the ids of the label scopes that limit k.
func labelIDs(c *Catalog, k *configv1.Key) []string {
	var out []string
	for _, ls := range c.LabelScopes(k) {
		out = append(out, ls.GetId())
	}
	return out
}

// TestLabelScopesOfAKey: a key is limited by the scope of its project and
// those of its tags (in its tag order), matched exactly within its org;
// labels without a scope, and other orgs' scopes of the same name, do not
// apply. Events add, change and remove scopes without touching the
// catalog they apply to.
func TestLabelScopesOfAKey(t *testing.T) {
	t.Parallel()
	snap := &configv1.Snapshot{
		Version: 1, Orgs: []*configv1.Org{{Id: "org_a"}, {Id: "org_b"}},
		LabelScopes: []*configv1.LabelScope{
			{Id: "lsc_p", OrgId: "org_a", Kind: LabelProject, Name: "search"},
			{Id: "lsc_t1", OrgId: "org_a", Kind: LabelTag, Name: "nightly"},
			{Id: "lsc_t2", OrgId: "org_a", Kind: LabelTag, Name: "eval"},
			// A tag named like the project is another scope.
			{Id: "lsc_t3", OrgId: "org_a", Kind: LabelTag, Name: "search"},
			{Id: "lsc_b", OrgId: "org_b", Kind: LabelProject, Name: "search"},
		},
	}
	c, err := FromSnapshot(snap, 0, nil)
	require.NoError(t, err)
	for _, tc := range []struct {
		key  *configv1.Key
		want []string
	}{
		{&configv1.Key{OrgId: "org_a", Project: "search", Tags: []string{"eval", "plain", "nightly"}}, []string{"lsc_p", "lsc_t2", "lsc_t1"}},
		{&configv1.Key{OrgId: "org_a", Tags: []string{"search"}}, []string{"lsc_t3"}},
		{&configv1.Key{OrgId: "org_a", Project: "Search"}, nil},
		{&configv1.Key{OrgId: "org_b", Project: "search", Tags: []string{"nightly"}}, []string{"lsc_b"}},
		{&configv1.Key{OrgId: "org_c", Project: "search"}, nil},
		{&configv1.Key{OrgId: "org_a"}, nil},
	} {
		require.Equal(t, tc.want, labelIDs(c, tc.key), "%v", tc.key)
	}
	require.Equal(t, 5, c.Counts()["label_scopes"])

	k := &configv1.Key{OrgId: "org_a", Project: "search", Tags: []string{"nightly", "new"}}
	limits := &configv1.Limits{RpmLimit: new(int64(9))}
	n := apply(t, c, 2, &configv1.Event{Change: &configv1.Event_LabelScope{LabelScope: &configv1.LabelScope{
		Id: "lsc_new", OrgId: "org_a", Kind: LabelTag, Name: "new", Limits: limits}}})
	require.Equal(t, []string{"lsc_p", "lsc_t1", "lsc_new"}, labelIDs(n, k))
	require.Equal(t, int64(9), n.LabelScopes(k)[2].GetLimits().GetRpmLimit())
	require.Equal(t, []string{"lsc_p", "lsc_t1"}, labelIDs(c, k), "the catalog an event applies to is unchanged")
	n = apply(t, n, 3, &configv1.Event{Change: &configv1.Event_LabelScopeDeleted{LabelScopeDeleted: "lsc_p"}})
	require.Equal(t, []string{"lsc_t1", "lsc_new"}, labelIDs(n, k))
	n = apply(t, n, 4, &configv1.Event{Change: &configv1.Event_LabelScopeDeleted{LabelScopeDeleted: "lsc_gone"}})
	require.Equal(t, []string{"lsc_t1", "lsc_new"}, labelIDs(n, k), "deleting an unknown scope changes nothing")

	// A snapshot of the same state equals the catalog built by events.
	snap2 := &configv1.Snapshot{Version: 2, Orgs: snap.Orgs, LabelScopes: []*configv1.LabelScope{
		snap.LabelScopes[1], snap.LabelScopes[2], snap.LabelScopes[3], snap.LabelScopes[4],
		{Id: "lsc_new", OrgId: "org_a", Kind: LabelTag, Name: "new", Limits: limits}}}
	c2, err := FromSnapshot(snap2, 0, nil)
	require.NoError(t, err)
	require.NoError(t, n.Equal(c2))
}
