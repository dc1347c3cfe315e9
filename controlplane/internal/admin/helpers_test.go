package admin

import (
	"encoding/json"

	"github.com/sluicegw/sluice/controlplane/internal/store"
)

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

func storeAuditAll() store.AuditQuery { return store.AuditQuery{} }
