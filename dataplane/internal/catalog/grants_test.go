package catalog

import (
	"testing"

	"github.com/stretchr/testify/require"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestModelGroupVisibility: a group is visible to an org when it is
// platform-wide or granted to the org; a model_group event carrying the
// group's new grants (a grant, a revocation) replaces them at once, and
// the catalog it was applied to is unchanged.
func TestModelGroupVisibility(t *testing.T) {
	t.Parallel()
	c, err := FromSnapshot(&configv1.Snapshot{ModelGroups: []*configv1.ModelGroup{
		{Name: "shared", PlatformWide: true},
		{Name: "private", GrantedOrgIds: []string{"org_a"}},
		{Name: "nobody"},
	}}, 0, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"private", "shared"}, c.VisibleModelGroups("org_a"))
	require.Equal(t, []string{"shared"}, c.VisibleModelGroups("org_b"))
	require.False(t, c.ModelGroupVisible("org_a", "nobody"))
	require.False(t, c.ModelGroupVisible("org_a", "missing"))
	require.True(t, c.HasModelGroup("nobody"), "it exists, it is just not visible")

	revoked, err := c.Apply(&configv1.Event{Seq: 1, Kind: "model_group.revoked", Security: true,
		Change: &configv1.Event_ModelGroup{ModelGroup: &configv1.ModelGroup{Name: "private"}}}, 1)
	require.NoError(t, err)
	require.False(t, revoked.ModelGroupVisible("org_a", "private"))
	require.True(t, c.ModelGroupVisible("org_a", "private"), "the old catalog is immutable")

	granted, err := revoked.Apply(&configv1.Event{Seq: 2, Kind: "model_group.granted",
		Change: &configv1.Event_ModelGroup{ModelGroup: &configv1.ModelGroup{Name: "nobody", GrantedOrgIds: []string{"org_a", "org_b"}}}}, 2)
	require.NoError(t, err)
	require.Equal(t, []string{"nobody", "shared"}, granted.VisibleModelGroups("org_b"))
}

// BenchmarkModelGroupVisible measures the grant check of every request
// against its baseline, the existence check it replaced (HasModelGroup),
// for a group granted to 30 orgs, the org asking being the last.
func BenchmarkModelGroupVisible(b *testing.B) {
	orgs := make([]string, 30)
	for i := range orgs {
		orgs[i] = "org_" + string(rune('a'+i%26)) + string(rune('a'+i/26))
	}
	c, err := FromSnapshot(&configv1.Snapshot{ModelGroups: []*configv1.ModelGroup{{Name: "g", GrantedOrgIds: orgs}}}, 0, nil)
	require.NoError(b, err)
	last := orgs[len(orgs)-1]
	b.Run("baseline_HasModelGroup", func(b *testing.B) {
		for b.Loop() {
			if !c.HasModelGroup("g") {
				b.Fatal("missing")
			}
		}
	})
	b.Run("ModelGroupVisible_30_grants", func(b *testing.B) {
		for b.Loop() {
			if !c.ModelGroupVisible(last, "g") {
				b.Fatal("not visible")
			}
		}
	})
}
