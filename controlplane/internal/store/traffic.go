package store

import (
	"context"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Traffic-class settings (SPEC §1, §7.2) live on their owners' rows as the
// JSON of their admin messages; the owners' reads return them (Org.Traffic,
// Deployment.Traffic, ModelGroup.Traffic) and these setters replace them.
// Read the owner FOR UPDATE first in the same transaction.

// OrgTrafficSet replaces o's traffic settings with traffic (JSON) and
// bumps its update time.
func (t *Tx) OrgTrafficSet(ctx context.Context, o *Org, traffic []byte) error {
	o.Traffic, o.UpdatedAt = traffic, t.now
	return translate(t.q.OrgTrafficSet(ctx, t.tx, dbsqlc.OrgTrafficSetParams{ID: o.ID, Traffic: traffic, UpdatedAt: t.now}))
}

// DeploymentTrafficSet replaces d's traffic settings with traffic (JSON)
// and bumps its update time.
func (t *Tx) DeploymentTrafficSet(ctx context.Context, d *Deployment, traffic []byte) error {
	d.Traffic, d.UpdatedAt = traffic, t.now
	return translate(t.q.DeploymentTrafficSet(ctx, t.tx, dbsqlc.DeploymentTrafficSetParams{ID: d.ID, Traffic: traffic, UpdatedAt: t.now}))
}

// ModelGroupTrafficSet replaces g's traffic settings with traffic (JSON)
// and bumps its update time.
func (t *Tx) ModelGroupTrafficSet(ctx context.Context, g *ModelGroup, traffic []byte) error {
	g.Traffic, g.UpdatedAt = traffic, t.now
	return translate(t.q.ModelGroupTrafficSet(ctx, t.tx, dbsqlc.ModelGroupTrafficSetParams{Name: g.Name, Traffic: traffic, UpdatedAt: t.now}))
}
