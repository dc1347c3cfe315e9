package admin

import (
	"context"

	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
)

// outbox appends the event kind about object id (of org orgID; "" for
// platform objects) to the mutation's outbox, with payload (nil, or the
// kind's payload type from package events).
func outbox(ctx context.Context, tx *store.Tx, kind events.Kind, orgID, id string, payload any) error {
	ev, err := events.New(kind, orgID, id, payload)
	if err != nil {
		return err
	}
	return tx.Outbox(ctx, ev)
}

// memberOutbox appends the member.* event kind of membership m.
func memberOutbox(ctx context.Context, tx *store.Tx, kind events.Kind, m store.TeamMember) error {
	ev, err := events.Member(kind, m.OrgID, m.TeamID, m.UserID)
	if err != nil {
		return err
	}
	return tx.Outbox(ctx, ev)
}
