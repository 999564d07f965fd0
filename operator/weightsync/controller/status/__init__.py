"""The WeightSync's status from a pass (`observed`), the Events its transitions
bring (`transitions`), and the problems that stop a pass early (`problems`). Pure."""
